// The FFI signatures both attention kernels take (decode_attention.cc, prefill_attention.cc):
// queries, keys, values (float32, or int8 codes with their float32 scales), the query
// positions, the window, and the scale as an attribute; the output, float32.
#pragma once
#include "xla/ffi/api/ffi.h"

namespace jaxgen_rows {

// q, k, v float32, positions, window -> out.
inline auto dense_attention_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<float>("scale");
}

// q float32, k, v int8 codes, k_scale, v_scale float32, positions, window -> out.
inline auto codes_attention_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S8>>()
      .Arg<ffi::Buffer<ffi::S8>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<float>("scale");
}

}  // namespace jaxgen_rows
