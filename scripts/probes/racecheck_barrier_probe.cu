// racecheck on the persistent kernel's statistics hand-over, without the kernel.
//
// The persistent attention kernel (cute_kernels/sm90/sparse_prefill.py) hands its row statistics from
// one consumer warpgroup to the other once per tile, reusing the same barriers tile after tile. This
// probe is that hand-over alone, with nothing else of the kernel, in three forms (argument `mode`):
//
//   0: named barriers, arrive -> sync (bar.arrive 3 + c by consumer c, bar.sync 3 + c by the other;
//      consumer 1's bar.arrive 7 at the start of tile t > 0, consumer 0's bar.sync 7 before writing
//      tile t), as the one-tile kernel hands its statistics over (barrier 7 aside);
//   1: mbarriers, as the persistent kernel does: stats_full[c] (128 arrivals of consumer c, both
//      consumers wait with parity t % 2) and tile_done (128 arrivals of consumer 1 after its tile,
//      consumer 0 waits with parity (t - 1) % 2 before writing tile t);
//   2: named barriers with bar.sync on both sides, the form the bf16 kernel's barriers take: all 256
//      threads bar.sync 3 after publishing and again at the end of the tile.
//
// Every form also exchanges a per-consumer table through bar.sync 5 + c (128 threads), as the
// kernel's output scales. `racy` = 1 breaks the cross-tile ordering on purpose, a real race (mode 0:
// no barrier 7; mode 1: consumer 0 writes tile t's statistics before its tile_done wait; mode 2: no
// bar.sync at the end of the tile): tile t's write may overtake the other consumer's read of t - 1.
//
//   mkdir -p build && nvcc -arch=sm_90a -o build/racecheck_barrier_probe scripts/probes/racecheck_barrier_probe.cu
//   compute-sanitizer --tool racecheck --racecheck-report hazard build/racecheck_barrier_probe TILES RACY MODE
//
// Per tile t, consumer 0 (threads 0-127) owns block 0, consumer 1 (128-255) block 1:
//   c0: (t > 0) wait for c1's end of tile t - 1; P0 (p_full arrive); publish s[.,0]
//   c1: p_full wait (c0's block 0 of tile t); publish s[.,1]
//   both: wait for both publications, read s[.,0..1]; then the per-consumer table
//   c1: its end of tile t
// c1's publication of tile t + 1 follows c0's reads of tile t through the p_full chain.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ unsigned smem(uint64_t* b) { return (unsigned)__cvta_generic_to_shared(b); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, int parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(smem(b)),
      "r"(parity)
      : "memory");
}

__global__ void probe(float* out, int tiles, int racy, int mode) {
  __shared__ float stats[2][64], scale[2][64];
  __shared__ uint64_t p_full, stats_full[2], tile_done;
  int c = threadIdx.x / 128, lane = threadIdx.x % 128, row = lane / 2;
  if (threadIdx.x == 0) {
    mbar_init(&p_full, 128);
    mbar_init(&stats_full[0], 128);
    mbar_init(&stats_full[1], 128);
    mbar_init(&tile_done, 128);
  }
  __syncthreads();
  float acc = 0.f;
  for (int t = 0; t < tiles; ++t) {
    float value = (c + 1) * t + row;
    if (c == 0) {  // wait for consumer 1's end of tile t - 1, then block 0 and the statistics
      if (mode == 0 && t > 0 && !racy) bar_sync(7, 256);
      if (mode == 1 && racy && lane % 2 == 0) stats[0][row] = value;
      if (mode == 1 && t > 0) mbar_wait(&tile_done, (t - 1) % 2);
      mbar_arrive(&p_full);
    } else {
      if (mode == 0 && t > 0 && !racy) bar_arrive(7, 256);  // consumer 1 finished tile t - 1
      mbar_wait(&p_full, t % 2);
    }
    if (lane % 2 == 0) stats[c][row] = value;
    if (mode == 0) {
      bar_arrive(3 + c, 256);
      bar_sync(4 - c, 256);
    } else if (mode == 1) {
      mbar_arrive(&stats_full[c]);
      mbar_wait(&stats_full[1 - c], t % 2);
      mbar_wait(&stats_full[c], t % 2);
    } else {
      bar_sync(3, 256);
    }
    acc += stats[0][row] + stats[1][row];
    if (lane % 2 == 0) scale[c][row] = value;  // the per-consumer table
    bar_sync(5 + c, 128);
    acc += scale[c][(row * 7) % 64];
    if (mode == 1 && c == 1) mbar_arrive(&tile_done);  // consumer 1's end of tile t
    if (mode == 2 && !racy) bar_sync(3, 256);
  }
  out[blockIdx.x * 256 + threadIdx.x] = acc;
}

int main(int argc, char** argv) {
  int tiles = argc > 1 ? atoi(argv[1]) : 4, racy = argc > 2 ? atoi(argv[2]) : 0, mode = argc > 3 ? atoi(argv[3]) : 1;
  float* out;
  cudaMalloc(&out, 4 * 256 * sizeof(float));
  probe<<<4, 256>>>(out, tiles, racy, mode);
  cudaError_t e = cudaDeviceSynchronize();
  printf("tiles %d racy %d mode %d: %s\n", tiles, racy, mode, cudaGetErrorString(e));
  return 0;
}
