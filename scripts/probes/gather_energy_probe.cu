// Gather-only energy probe (H100/H200, sm_90a): what one call's KV row gather costs in time and joules
// when the two head-group CTAs of a token (h_q = 128) each gather the token's rows (as q8kv8 does now)
// against a 2-CTA cluster in which each row's 512 "nope" bytes are read from L2 once and multicast by TMA
// into both CTAs' shared memory.
//
// Not part of the library: a measurement for docs/perf-notes.md. Each CTA walks its token's topk rows in
// blocks of 64 through a ring of 4 shared-memory slots (36 KB each, 205 KB of shared memory per CTA so one
// CTA per SM, as the kernel), with a producer warpgroup filling slots and one consumer warp releasing them
// (no math). Variants:
//   cpasync      every CTA copies its 64 rows x 576 B per block with 16-byte cp.async (the kernel's way)
//   tma          every CTA: 4 TMA boxes of 128 B (SWIZZLE_128B) per row for bytes 0..511 + cp.async rope
//   tma_mcast    2-CTA cluster (the token's two head groups): each CTA issues the 4 boxes for half of the
//                rows with multicast to both CTAs, and cp.async's its own rope; slots are released
//                cluster-wide (each consumer arrives on both CTAs' empty barriers)
//   hybrid       tma_mcast for the first HYBRID_TMA_ROWS rows of each block, cp.async for the others
// Compile-time knobs: -DPRODUCER_WARPS=4|8 (warps issuing the copies), -DHYBRID_TMA_ROWS=48,
// -DROPE=0 (leave the rope bytes out: TMA's own rate; the verify pass then fails by design).
// Outcome on the H200 (docs/perf-notes.md): TMA's 128-byte boxes cap the gather near 3.5 TB/s.
// A verify pass XORs every 16-byte granule each CTA received and compares with the host's XOR of the rows.
// Energy: NVML's total-energy counter over a ~2 s run of back-to-back calls.
//
// Build and run (on an SM90 GPU; build/ is ignored by git):
//   mkdir -p build && nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Wno-deprecated-declarations \
//     -o build/gather_energy_probe scripts/probes/gather_energy_probe.cu -ldl
//   build/gather_energy_probe [s_kv ...]

#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#define CHECK(call)                                                                                    \
  do {                                                                                                 \
    cudaError_t err_ = (call);                                                                         \
    if (err_ != cudaSuccess) {                                                                         \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_));          \
      exit(1);                                                                                         \
    }                                                                                                  \
  } while (0)

constexpr int kRowBytes = 576, kNopeBytes = 512, kBlockRows = 64, kRing = 4;  // rope: bytes 512..575
constexpr int kSlotBytes = kBlockRows * kRowBytes;         // 36864: 4 nope chunk tiles (8 KB) + rope (4 KB)
constexpr int kChunkTileBytes = kBlockRows * 128;          // one 128-byte column chunk of 64 rows
constexpr int kRopeOffset = 4 * kChunkTileBytes;           // 32768
constexpr int kSmemBytes = 205 * 1024;                     // one CTA per SM, as the kernel
#ifndef ROPE
#define ROPE 1
#endif
#ifndef PRODUCER_WARPS
#define PRODUCER_WARPS 4  // -DPRODUCER_WARPS=8: more warps issuing the copies
#endif
constexpr int kProducerThreads = 32 * PRODUCER_WARPS, kThreads = kProducerThreads + 32;

enum Variant { kCpAsync = 0, kTma = 1, kTmaMcast = 2, kHybrid = 3 };
#ifndef HYBRID_TMA_ROWS
#define HYBRID_TMA_ROWS 48  // rows of each 64-row block the hybrid multicasts by TMA (even)
#endif
__host__ __device__ constexpr bool clustered(int v) { return v == kTmaMcast || v == kHybrid; }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{ .reg .b32 remote; mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote]; }" ::"r"(bar),
      "r"(cta)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{ .reg .pred done; WAIT_%=: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=; }" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void tma_row(uint32_t dst, const CUtensorMap* map, int col, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(dst),
      "l"(map), "r"(col), "r"(row), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_row_mcast(uint32_t dst, const CUtensorMap* map, int col, int row, uint32_t bar,
                                              uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(map), "r"(col), "r"(row), "r"(bar), "h"(mask)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Byte offset of 16-byte granule g (0..35) of slot row r: nope granules in 128-byte swizzled chunk tiles
// (the layout TMA's SWIZZLE_128B writes), rope granules in a 64-byte swizzled tile.
__device__ __forceinline__ uint32_t granule_offset(int r, int g) {
  if (g < 32) return (g >> 3) * kChunkTileBytes + r * 128 + (((g & 7) ^ (r & 7)) << 4);
  return kRopeOffset + r * 64 + ((((g - 32) & 3) ^ ((r >> 1) & 3)) << 4);
}

template <int V>
__global__ void __launch_bounds__(kThreads, 1)
    gather_kernel(const __grid_constant__ CUtensorMap map, const uint8_t* __restrict__ kv,
                  const int* __restrict__ indices, int topk, uint4* __restrict__ xor_out, int verify) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kRing * kSlotBytes);
  uint64_t* empty = full + kRing;
  const int token = blockIdx.x / 2;
  const uint32_t rank = clustered(V) ? cluster_rank() : 0;
  const int tid = threadIdx.x;
  const int num_blocks = topk / kBlockRows;
  const int* row_index = indices + static_cast<size_t>(token) * topk;

  if (tid == 0) {
    for (int s = 0; s < kRing; ++s) {
      mbar_init(smem_u32(&full[s]), V == kCpAsync ? kProducerThreads : kProducerThreads + 1);
      mbar_init(smem_u32(&empty[s]), clustered(V) ? 2 : 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (clustered(V)) cluster_sync(); else __syncthreads();

  if (tid < kProducerThreads) {
    for (int j = 0; j < num_blocks; ++j) {
      const int slot = j % kRing;
      const uint32_t round = j / kRing;
      const uint32_t slot_base = smem_u32(smem + slot * kSlotBytes);
      const uint32_t full_bar = smem_u32(&full[slot]);
      mbar_wait(smem_u32(&empty[slot]), (round & 1) ^ 1);
      const int* block_index = row_index + j * kBlockRows;
      // Rows [0, tma_rows) by TMA (none for cpasync, all for tma, tma_mcast; HYBRID_TMA_ROWS for hybrid),
      // the rest of the nope bytes by cp.async, one row per warp instruction (lane = 16-byte granule).
      constexpr int tma_rows = V == kCpAsync ? 0 : V == kHybrid ? HYBRID_TMA_ROWS : kBlockRows;
      if (tma_rows > 0 && tid == 0) mbar_arrive_expect_tx(full_bar, tma_rows * kNopeBytes);
      if (V == kTma) {
        for (int k = tid; k < tma_rows * 4; k += kProducerThreads) {
          const int r = k / 4, c = k % 4;
          tma_row(slot_base + c * kChunkTileBytes + r * 128, &map, c * 128, block_index[r], full_bar);
        }
      } else if (V == kTmaMcast || V == kHybrid) {  // this CTA issues the rows of its parity, for both
        for (int k = tid; k < tma_rows / 2 * 4; k += kProducerThreads) {
          const int r = 2 * (k / 4) + rank, c = k % 4;
          tma_row_mcast(slot_base + c * kChunkTileBytes + r * 128, &map, c * 128, block_index[r], full_bar, 0x3);
        }
      }
      const int warp = tid / 32, lane = tid % 32;
      for (int r = tma_rows + warp; r < kBlockRows; r += PRODUCER_WARPS) {
        cp_async16(slot_base + granule_offset(r, lane), kv + static_cast<size_t>(block_index[r]) * kRowBytes + lane * 16);
      }
      // Rope granules (bytes 512..575) of every row by cp.async, 8 rows per warp instruction.
      for (int r = warp * 8 + lane / 4; r < (ROPE ? kBlockRows : 0); r += PRODUCER_WARPS * 8) {
        const int g = 32 + lane % 4;  // -DROPE=0: leave the rope out (TMA bytes only; verify then fails)
        cp_async16(slot_base + granule_offset(r, g), kv + static_cast<size_t>(block_index[r]) * kRowBytes + g * 16);
      }
      cp_async_arrive_noinc(full_bar);
    }
  } else {
    const int lane = tid - kProducerThreads;
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int j = 0; j < num_blocks; ++j) {
      const int slot = j % kRing;
      mbar_wait(smem_u32(&full[slot]), (j / kRing) & 1);
      if (verify) {
        const uint4* granules = reinterpret_cast<const uint4*>(smem + slot * kSlotBytes);
        for (int k = lane; k < kSlotBytes / 16; k += 32) {
          const uint4 v = granules[k];
          acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
        }
      }
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(smem_u32(&empty[slot]));
        if (clustered(V)) mbar_arrive_cluster(smem_u32(&empty[slot]), rank ^ 1);
      }
    }
    if (verify) {
      atomicXor(&xor_out[blockIdx.x].x, acc.x);
      atomicXor(&xor_out[blockIdx.x].y, acc.y);
      atomicXor(&xor_out[blockIdx.x].z, acc.z);
      atomicXor(&xor_out[blockIdx.x].w, acc.w);
    }
  }
  if (clustered(V)) cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers
}

// NVML, loaded at run time (no header needed).
struct Nvml {
  using Device = void*;
  int (*init)() = nullptr;
  int (*handle)(unsigned, Device*) = nullptr;
  int (*energy)(Device, unsigned long long*) = nullptr;
  int (*power)(Device, unsigned*) = nullptr;
  int (*clock)(Device, int, unsigned*) = nullptr;
  Device device = nullptr;
  bool ok = false;
  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) return;
    init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    handle = reinterpret_cast<int (*)(unsigned, Device*)>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    energy = reinterpret_cast<int (*)(Device, unsigned long long*)>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    power = reinterpret_cast<int (*)(Device, unsigned*)>(dlsym(lib, "nvmlDeviceGetPowerUsage"));
    clock = reinterpret_cast<int (*)(Device, int, unsigned*)>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    ok = init && handle && energy && power && clock && init() == 0 && handle(0, &device) == 0;
  }
  unsigned long long energy_mj() { unsigned long long e = 0; if (ok) energy(device, &e); return e; }
  unsigned power_mw() { unsigned p = 0; if (ok) power(device, &p); return p; }
  unsigned sm_mhz() { unsigned c = 0; if (ok) clock(device, 1 /* NVML_CLOCK_SM */, &c); return c; }
};

using LaunchFn = void (*)(const CUtensorMap&, const uint8_t*, const int*, int, uint4*, int, int, cudaStream_t);

template <int V>
void launch(const CUtensorMap& map, const uint8_t* kv, const int* idx, int topk, uint4* out, int verify, int ctas,
            cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = clustered(V) ? 2 : 1;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&config, gather_kernel<V>, map, kv, idx, topk, out, verify));
}

int main(int argc, char** argv) {
  const int s_q = 4096, topk = 2048, ctas = 2 * s_q;  // h_q = 128: two head-group CTAs per token
  std::vector<int> contexts;
  for (int i = 1; i < argc; ++i) contexts.push_back(atoi(argv[i]));
  if (contexts.empty()) contexts = {65536, 8192};
  const char* names[] = {"cpasync", "tma", "tma_mcast", "hybrid"};
  LaunchFn launches[] = {launch<kCpAsync>, launch<kTma>, launch<kTmaMcast>, launch<kHybrid>};
  for (auto fn : {gather_kernel<kCpAsync>, gather_kernel<kTma>, gather_kernel<kTmaMcast>, gather_kernel<kHybrid>})
    CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));

  using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* encode_ptr = nullptr;
  cudaDriverEntryPointQueryResult query;
  CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &encode_ptr, cudaEnableDefault, &query));
  auto encode = reinterpret_cast<EncodeFn>(encode_ptr);
  Nvml nvml;
  printf("nvml %s; idle power %.0f W\n", nvml.ok ? "ok" : "unavailable", nvml.power_mw() / 1000.0);

  for (int s_kv : contexts) {
    std::mt19937 rng(1234 + s_kv);
    std::vector<uint8_t> kv_host(static_cast<size_t>(s_kv) * kRowBytes);
    for (auto& b : kv_host) b = static_cast<uint8_t>(rng());
    std::vector<int> idx_host(static_cast<size_t>(s_q) * topk);
    for (auto& i : idx_host) i = static_cast<int>(rng() % s_kv);
    std::vector<uint4> expected(ctas);
    for (int t = 0; t < s_q; ++t) {
      uint4 acc = {0, 0, 0, 0};
      for (int k = 0; k < topk; ++k) {
        const uint4* row = reinterpret_cast<const uint4*>(&kv_host[static_cast<size_t>(idx_host[t * topk + k]) * kRowBytes]);
        for (int g = 0; g < 36; ++g) acc.x ^= row[g].x, acc.y ^= row[g].y, acc.z ^= row[g].z, acc.w ^= row[g].w;
      }
      expected[2 * t] = expected[2 * t + 1] = acc;
    }
    uint8_t* kv;
    int* idx;
    uint4* xor_out;
    CHECK(cudaMalloc(&kv, kv_host.size()));
    CHECK(cudaMalloc(&idx, idx_host.size() * sizeof(int)));
    CHECK(cudaMalloc(&xor_out, ctas * sizeof(uint4)));
    CHECK(cudaMemcpy(kv, kv_host.data(), kv_host.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(idx, idx_host.data(), idx_host.size() * sizeof(int), cudaMemcpyHostToDevice));
    CUtensorMap map;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kRowBytes), static_cast<cuuint64_t>(s_kv)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kRowBytes)};
    const cuuint32_t box[2] = {128, 1}, element_strides[2] = {1, 1};
    if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, kv, dims, strides, box, element_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      fprintf(stderr, "cuTensorMapEncodeTiled failed\n");
      return 1;
    }
    const double gathered_gb = 2.0 * s_q * topk * kRowBytes / 1e9;  // bytes landing in shared memory
    printf("\ns_kv %d: %d CTAs x %d rows x %d B = %.2f GB into shared memory per call\n", s_kv, ctas, topk,
           kRowBytes, gathered_gb);
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    for (int v = 0; v < 4; ++v) {
      CHECK(cudaMemset(xor_out, 0, ctas * sizeof(uint4)));
      launches[v](map, kv, idx, topk, xor_out, 1, ctas, stream);
      CHECK(cudaStreamSynchronize(stream));
      std::vector<uint4> got(ctas);
      CHECK(cudaMemcpy(got.data(), xor_out, ctas * sizeof(uint4), cudaMemcpyDeviceToHost));
      int bad = 0;
      for (int c = 0; c < ctas; ++c) bad += memcmp(&got[c], &expected[c], sizeof(uint4)) != 0;
      for (int i = 0; i < 3; ++i) launches[v](map, kv, idx, topk, xor_out, 0, ctas, stream);
      CHECK(cudaEventRecord(start, stream));
      const int timed = 20;
      for (int i = 0; i < timed; ++i) launches[v](map, kv, idx, topk, xor_out, 0, ctas, stream);
      CHECK(cudaEventRecord(stop, stream));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      ms /= timed;
      const int calls = static_cast<int>(2000.0 / ms);
      const unsigned long long e0 = nvml.energy_mj();
      const auto t0 = std::chrono::steady_clock::now();
      unsigned clock_sum = 0, power_sum = 0, samples = 0;
      for (int i = 0; i < calls; ++i) {
        launches[v](map, kv, idx, topk, xor_out, 0, ctas, stream);
        if (i > calls / 4 && i < 3 * calls / 4 && i % 64 == 0) {
          clock_sum += nvml.sm_mhz(), power_sum += nvml.power_mw() / 1000, ++samples;
        }
      }
      CHECK(cudaStreamSynchronize(stream));
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double joules = (nvml.energy_mj() - e0) / 1000.0;
      printf("  %-10s verify %s (%d of %d CTAs wrong)  %.3f ms/call (%.0f GB/s)  steady: %.3f ms/call  %.0f W  "
             "%.3f J/call  SM %u MHz (%u W sampled)\n",
             names[v], bad ? "FAIL" : "ok", bad, ctas, ms, gathered_gb / ms * 1e3, seconds * 1e3 / calls,
             joules / seconds, joules / calls, samples ? clock_sum / samples : 0, samples ? power_sum / samples : 0);
      fflush(stdout);
    }
    CHECK(cudaFree(kv));
    CHECK(cudaFree(idx));
    CHECK(cudaFree(xor_out));
  }
  return 0;
}
