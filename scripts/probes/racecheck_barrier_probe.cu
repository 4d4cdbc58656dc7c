// racecheck on the persistent kernel's statistics hand-over, without the kernel.
//
// compute-sanitizer --tool racecheck reports "Potential RAW hazard" on s_max_own in the persistent
// attention kernel when a CTA walks several tiles (writer: consumer 0's publish_row_stats, reader:
// consumer 1's epilogue), although every access is ordered (tests/test_persistent_protocol.py models
// it). This probe is that protocol alone, ordered the same way, with nothing else in the kernel:
//
//   nvcc -arch=sm_90a -o /tmp/probe scripts/probes/racecheck_barrier_probe.cu
//   compute-sanitizer --tool racecheck --racecheck-report hazard /tmp/probe 4     # 0 hazards
//   compute-sanitizer --tool racecheck --racecheck-report hazard /tmp/probe 8     # RAW "hazards"
//   compute-sanitizer --tool racecheck --racecheck-report hazard /tmp/probe 4 1   # a real race: WAR
//
// H200, CUDA 13.0: 4 tiles 0 hazards, 8 tiles 896 RAW reports (write by consumer 0 before its
// bar.arrive 3, read by consumer 1 after its bar.sync 3), and with barrier 7 dropped (a real race)
// 128 WAR reports. racecheck loses the arrive -> sync ordering of a reused named barrier after a few
// generations; a real overwrite of the statistics shows up as WAR.
//
// The persistent kernel's statistics protocol without its math, for racecheck (every access ordered).
// Per tile, consumer 0 (threads 0-127) owns block 0, consumer 1 (128-255) block 1:
//   c1: tile start (t > 0): bar.arrive 7            c0: (t > 0) bar.sync 7 before its first P
//   c0: P0, mbarrier p_full arrive; publish s[.,0], bar.arrive 3
//   c1: mbarrier p_full wait (c0's block 0 of this tile); publish s[.,1], bar.arrive 4
//   c0: epilogue: bar.sync 4, read s[.,0..1]        c1: epilogue: bar.sync 3, read s[.,0..1]
// c1's publish of tile t + 1 follows c0's epilogue of tile t through the p_full chain.
// racy = 1 drops barrier 7: c0's publish of tile t + 1 may then overwrite what c1 still reads (a real race).
#include <cstdio>
#include <cstdint>
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"((unsigned)__cvta_generic_to_shared(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, int parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(
          (unsigned)__cvta_generic_to_shared(b)),
      "r"(parity)
      : "memory");
}

__global__ void probe(float* out, int tiles, int racy) {
  __shared__ float stats[2][64];
  __shared__ uint64_t p_full;
  int c = threadIdx.x / 128, lane = threadIdx.x % 128, row = lane / 2;
  if (threadIdx.x == 0) mbar_init(&p_full, 128);
  __syncthreads();
  float acc = 0.f;
  for (int t = 0; t < tiles; ++t) {
    if (c == 0) {
      if (t > 0 && !racy) bar_sync(7, 256);
      mbar_arrive(&p_full);
      if (lane % 2 == 0) stats[0][row] = t + row;
      bar_arrive(3, 256);
      bar_sync(4, 256);
      acc += stats[0][row] + stats[1][row];
    } else {
      if (t > 0 && !racy) bar_arrive(7, 256);
      mbar_wait(&p_full, t % 2);
      if (lane % 2 == 0) stats[1][row] = 2 * t + row;
      bar_arrive(4, 256);
      bar_sync(3, 256);
      acc += stats[0][row] + stats[1][row];
    }
    bar_sync(5 + c, 128);
  }
  out[blockIdx.x * 256 + threadIdx.x] = acc;
}

int main(int argc, char** argv) {
  int tiles = argc > 1 ? atoi(argv[1]) : 4, racy = argc > 2 ? atoi(argv[2]) : 0;
  float* out;
  cudaMalloc(&out, 4 * 256 * sizeof(float));
  probe<<<4, 256>>>(out, tiles, racy);
  cudaError_t e = cudaDeviceSynchronize();
  printf("tiles %d racy %d: %s\n", tiles, racy, cudaGetErrorString(e));
  return 0;
}
