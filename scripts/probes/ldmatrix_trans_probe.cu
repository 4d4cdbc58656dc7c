// The shared-memory cost of the V^T fragment loads, without the kernel.
//
// The FP8 attention kernels (cute_kernels/sm90/sparse_prefill.py, load_v_fragment) read the A operand of
// the PV product, V^T, from a gathered block tile with ldmatrix.x4.trans: lane L addresses slot 32 h + L,
// 16-byte chunk w (the warp's) of a [64 slots x 64 bytes] column tile in the 64-byte swizzle (chunk c of
// row r stored at chunk c ^ ((r >> 1) & 3)). Those addresses hit every bank once per 8x8 matrix, so the
// load should take 4 shared-memory wavefronts, as the plain ldmatrix.x4 and a 16-byte ld.shared.v4 per
// lane do; a profile of the kernel counted about 8.6 per request. This probe times each form alone on the
// same addresses (argument `mode`):
//
//   0: ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 (the kernel's load)
//   1: ldmatrix.sync.aligned.m8n8.x4.shared.b16 (the same matrices, not transposed)
//   2: ld.shared.v4.b32, the same 16 bytes per lane
//
// Every warp of every CTA loads in a loop over the two halves (slots 0-31, 32-63) and four column tiles;
// the loads are independent (their results are XORed into one register), so the shared-memory pipe is
// what bounds the loop. It prints the SM cycles per load instruction per SM (clock64 over the loop,
// slowest warp; the loads of all warps on the SM share the pipe) and the elapsed time.
//
//   mkdir -p build && nvcc -arch=sm_90a -O3 -o build/ldmatrix_trans_probe scripts/probes/ldmatrix_trans_probe.cu
//   build/ldmatrix_trans_probe MODE [ITERS]
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

constexpr int kThreads = 512;  // 16 warps per CTA, one CTA per SM
constexpr int kTileBytes = 64 * 64;
constexpr int kTiles = 4;

template <int kMode>
__device__ __forceinline__ uint32_t load(uint32_t addr) {
  uint32_t a, b, c, d;
  if constexpr (kMode == 0) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "r"(addr));
  } else if constexpr (kMode == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "r"(addr));
  } else {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr));
  }
  return a ^ b ^ c ^ d;
}

template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) probe(int iters, uint32_t* sink, long long* cycles) {
  __shared__ __align__(1024) uint8_t smem[kTiles * kTileBytes];
  for (int i = threadIdx.x; i < kTiles * kTileBytes / 4; i += blockDim.x) {
    reinterpret_cast<uint32_t*>(smem)[i] = i * 2654435761u;
  }
  __syncthreads();
  const int warp = (threadIdx.x / 32) % 4;  // the 16-byte chunk of the 64-byte row this warp reads
  const int lane = threadIdx.x % 32;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint32_t addrs[2 * kTiles];
  for (int half = 0; half < 2; ++half) {
    const int row = half * 32 + lane;
    for (int tile = 0; tile < kTiles; ++tile) {
      addrs[half * kTiles + tile] = base + tile * kTileBytes + row * 64 + 16 * (warp ^ ((row >> 1) & 3));
    }
  }
  uint32_t acc = 0;
  const long long start = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 2 * kTiles; ++i) acc ^= load<kMode>(addrs[i]);
  }
  const long long stop = clock64();
  if (acc == 0x12345678u) sink[threadIdx.x] = acc;  // keeps the loads
  if (lane == 0) atomicMax(cycles + blockIdx.x, stop - start);
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0;
  const int iters = argc > 2 ? atoi(argv[2]) : 4096;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint32_t* sink;
  long long* cycles;
  cudaMalloc(&sink, kThreads * sizeof(uint32_t));
  cudaMalloc(&cycles, sms * sizeof(long long));
  auto launch = [&] {
    cudaMemset(cycles, 0, sms * sizeof(long long));
    if (mode == 0) probe<0><<<sms, kThreads>>>(iters, sink, cycles);
    if (mode == 1) probe<1><<<sms, kThreads>>>(iters, sink, cycles);
    if (mode == 2) probe<2><<<sms, kThreads>>>(iters, sink, cycles);
  };
  launch();  // warm-up
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0);
  launch();
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  long long* host = new long long[sms];
  cudaMemcpy(host, cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  long long worst = 0;
  for (int i = 0; i < sms; ++i) worst = host[i] > worst ? host[i] : worst;
  const double loads_per_sm = double(iters) * 2 * kTiles * (kThreads / 32);
  printf("mode %d (%s): %.2f SM cycles per load instruction per SM, %.3f ms, %s\n", mode,
         mode == 0 ? "ldmatrix.x4.trans" : mode == 1 ? "ldmatrix.x4" : "ld.shared.v4", worst / loads_per_sm, ms,
         cudaGetErrorString(cudaGetLastError()));
  return 0;
}
