"""Runs the FlashMLA peer kit's check and timing (its bench.py) on a shape that is not in its SHAPES list.

    python3 tools/flashmla_shape.py .peer/flashmla 8x4096h128q64 [bench.py's options: --no-check --reps 1 ...]

The shape is BxL (uniform lengths), hH (query heads) and qS (query tokens a request, causal when S > 1), the
names our arg_specs' extend shapes have. scripts/ncu_peer.sh uses it to profile FlashMLA beside us on such
shapes; the kit itself stays as its README gives it.
"""
import re
import sys


def parse(shape):
    m = re.fullmatch(r"(\d+)x(\d+)h(\d+)q(\d+)", shape)
    if not m:
        raise ValueError(f"shape {shape!r}: expected BxLhHqS, e.g. 8x4096h128q64")
    b, l, h, q = map(int, m.groups())
    return (f"{b}x{l} h{h} q{q}", (b, l), h, q)


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    kit, shape, rest = argv[1], parse(argv[2]), argv[3:]
    sys.path.insert(0, kit)
    import bench  # the kit's bench.py
    bench.SHAPES = [shape]
    sys.argv = [argv[0], "--only", "0", *rest]
    bench.main()


if __name__ == "__main__":
    main(sys.argv)
