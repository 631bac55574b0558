// jax_mla._native_cuda: the CUDA handler of the op as an XLA FFI capsule, and a
// check that this library can run on the machine's devices. Python imports it
// only when JAX has a CUDA device (jax_mla/_ffi.py), and registers the handler
// only when device_status() finds code for every device's arch.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "bindings_common.h"
#include "xla/ffi/api/c_api.h"

// Exported by ffi/cuda/mla_attention.cu (plain C: this file needs no CUDA headers).
extern "C" {
XLA_FFI_Error* JaxMlaPagedAttentionCuda(XLA_FFI_CallFrame* call_frame);
int JaxMlaCudaRuntimeVersion();
int JaxMlaCudaDeviceCount(int* count);
int JaxMlaCudaDriverVersion(int* version);
const char* JaxMlaCudaErrorString(int err);
int JaxMlaCudaDeviceStatus(int device, int* compute_capability, int* kernel);
}

namespace nb = nanobind;

namespace {

// 13000 -> "13.0"
std::string cuda_version_str(int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); }

// One dict per device: its compute capability, the attention kernel the launch code picks there,
// and an error string (None when the library runs there). Raises RuntimeError when there is no
// usable CUDA driver or device at all.
nb::dict device_status() {
  nb::dict status;
  int driver = 0;
  JaxMlaCudaDriverVersion(&driver);
  status["driver"] = driver > 0 ? nb::object(nb::str(cuda_version_str(driver).c_str())) : nb::none();
  status["runtime"] = cuda_version_str(JaxMlaCudaRuntimeVersion());
  int count = 0;
  const int err = JaxMlaCudaDeviceCount(&count);
  if (err != 0) {
    throw std::runtime_error(std::string("jax_mla CUDA: no usable device (cudaGetDeviceCount: ") +
                             JaxMlaCudaErrorString(err) + "; driver supports CUDA " +
                             (driver > 0 ? cuda_version_str(driver) : std::string("none")) +
                             ", the library needs a driver for CUDA >= " +
                             cuda_version_str(JaxMlaCudaRuntimeVersion()) + ")");
  }
  nb::list devices;
  for (int d = 0; d < count; ++d) {
    int cc = 0, kernel = 0;
    const int e = JaxMlaCudaDeviceStatus(d, &cc, &kernel);
    nb::dict dev;
    dev["device"] = d;
    dev["compute_capability"] = nb::make_tuple(cc / 10, cc % 10);
    dev["kernel"] = kernel == 2 ? "wgmma sm_90a" : "mma.sync portable";
    dev["error"] = e == 0 ? nb::object(nb::none()) : nb::object(nb::str(JaxMlaCudaErrorString(e)));
    devices.append(dev);
  }
  status["devices"] = devices;
  return status;
}

}  // namespace

NB_MODULE(_native_cuda, m) {
  m.doc() = "jax_mla's CUDA XLA FFI handler (loaded only where JAX has a CUDA device).";
  m.def("registrations", []() { return jax_mla::attention_registrations(JaxMlaPagedAttentionCuda); },
        "XLA FFI target name -> handler capsule, for platform 'CUDA'.");
  m.def("device_status", &device_status,
        "Driver and runtime versions, and per device: compute capability, the kernel that runs "
        "there, and an error when the library holds no code for the device's arch.");
}
