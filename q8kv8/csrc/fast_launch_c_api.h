// The C interface between q8kv8's two host libraries: fast_launch.cc (built against TVM-FFI: the checks,
// the registered kernel variants, the launch) and fast_call.cc (a CPython extension built against torch:
// reads the torch tensors of a call, allocates its outputs, and calls in here).
//
// fast_launch.cc's q8kv8_fast_c_api (a TVM-FFI function) returns the address of a Q8kv8FastCApi, which
// q8kv8/fast_call.py hands to fast_call.cc's bind(). Both libraries include this header; the digests that
// name their build caches include it (q8kv8/native_build.py).

#ifndef Q8KV8_FAST_LAUNCH_C_API_H_
#define Q8KV8_FAST_LAUNCH_C_API_H_

#include <dlpack/dlpack.h>
#include <stdint.h>

#define Q8KV8_FAST_C_API_VERSION 1

// A public call's arguments as DLPack views (valid for the call only) and scalars.
typedef struct {
  const DLTensor* q;
  const DLTensor* kv;
  const DLTensor* indices;
  const DLTensor* q_scale;
  const DLTensor* kv_scale;
  const DLTensor* attn_sink;    // NULL when absent
  const DLTensor* topk_length;  // NULL when absent
  // All three NULL: the caller allocates them after plan() takes the call, then launch() checks them.
  const DLTensor* out;
  const DLTensor* max_logits;
  const DLTensor* lse;
  double sm_scale;
  int32_t precision;  // 0 "default", 1 "accurate"
} Q8kv8Call;

// What plan() decided; opaque to the caller except schedule (-1: declined, nothing to launch).
typedef struct {
  int64_t schedule;
  const void* variant;
  const void* device;
  double logit_scale;
  int64_t flags;
  int32_t outputs_checked;
  const char* declined;  // why, when declined
} Q8kv8Plan;

typedef struct {
  int32_t version;  // Q8KV8_FAST_C_API_VERSION
  // The fast path's checks (those of q8kv8_fast_plan); with the outputs NULL, of everything else.
  void (*plan)(const Q8kv8Call* call, Q8kv8Plan* plan);
  // Launches plan's variant on `stream` (set as TVM-FFI's environment stream of the call's device for the
  // launch when set_stream is nonzero). Returns 0 when launched, 1 when declined (outputs that plan() did
  // not check fail their checks: nothing launched), -1 when the launch raised (the error is kept for
  // q8kv8_fast_rethrow, the TVM-FFI function that raises it).
  int32_t (*launch)(const Q8kv8Call* call, const Q8kv8Plan* plan, int32_t set_stream, void* stream);
} Q8kv8FastCApi;

#endif  // Q8KV8_FAST_LAUNCH_C_API_H_
