// linear_bf16 on Intel's Advanced Matrix Extensions (AMX): the same product on the same packed
// panels, for CPUs whose tile unit multiplies bfloat16 matrices (Sapphire Rapids and later).
//
// The AVX-512 panels (linear_panels.cc) read the weights at the speed of memory for one row,
// but their arithmetic, one VDPBF16PS per 16 outputs, input pair and row, is what bounds a step
// of 4 rows and more on these CPUs: a draft tree of 16 nodes costs several times a token. A
// tile instruction (TDPBF16PS) does 16 rows x 16 outputs x 16 input pairs at once, so a step of
// up to 16 rows costs what reading the weights costs, and a prefill runs at the tile unit's
// speed.
//
// Layout, from the panels as they are packed (panel p: [in_features / 2][64][2]):
// - a weight tile is 16 input pairs x 16 outputs x 2: rows of 64 bytes, 256 bytes apart in the
//   panel (the four tiles of 16 outputs read a 4 KB stretch of the panel front to back);
// - an input tile is 16 rows of x x 16 input pairs: rows of 64 bytes, a row of x apart;
// - the sums are four tiles of 16 rows x 16 float32 outputs, kept in the tile registers over
//   the input pairs of a block and stored to memory between blocks.
// Rows go 16 at a time; the last group of fewer than 16 rows reads its input tile from a copy
// padded to a whole tile (a tile load reads whole rows: past the end of x it could fault).
// Inputs go in blocks of kPairBlock pairs, so that further row groups find a block of the panel
// in the core's cache.
//
// A row's result depends on that row alone: each output row of TDPBF16PS is its input row
// times the weights, the pairs added in order, whatever the other rows of the tile hold. The
// result is not promised to equal the AVX-512 panels' bits (the tile unit may order the sums of
// an instruction differently), so the decoder uses one of the two for all of its products.
//
// Compiled with -mamx-tile -mamx-bf16 (CMakeLists.txt); called only where has_amx_bf16() says
// the CPU has the tile unit and the kernel lets this process use it.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cpuid.h>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "amx_tiles.h"
#include "kernels.h"

namespace sssd::kernels {
namespace {

constexpr int64_t kPanel = 64;          // outputs per panel, as linear_panels.cc packs them
constexpr int64_t kTileRows = 16;       // rows of x per input tile
constexpr int64_t kTilePairs = 16;      // input pairs per tile (64 bytes of bfloat16)
constexpr int64_t kPairBlock = 1024;    // input pairs per block: 256 KB of a panel

// Linux's request for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// The tiles (detail::kTiles16x64): tmm0-3 the sums of 64 outputs (16 rows x 16 float32), tmm4
// the input tile (16 rows x 16 pairs), tmm5-7 weight tiles (16 pairs x 16 outputs x 2).
static_assert(kTileRows == 16 && kTilePairs * 4 == 64, "tiles of 16 rows of 64 bytes");

bool probe_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool has_tile = (edx >> 24) & 1u;
  const bool has_bf16 = (edx >> 22) & 1u;
  if (!has_tile || !has_bf16 || !__builtin_cpu_supports("avx512bf16")) return false;
  // Granted once for the whole process (every thread); PyTorch's oneDNN asks the same.
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Adds input pairs [begin, end) (a multiple of kTilePairs apart) of panel `panel` to the sums
// of one group of 16 rows: `x` the group's first row (rows `x_stride` bytes apart), `sums`
// [16][64] float32, loaded first unless `first`, stored after. `streams`: this group is the
// first to read the block, from memory (the others find it in the core's cache).
void add_block(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t begin,
               int64_t end, float* sums, bool first, bool streams) {
  constexpr int64_t kSumStride = kPanel * sizeof(float);
  constexpr int64_t kPanelRow = kPanel * 2 * sizeof(uint16_t);  // one pair of 64 outputs
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, sums, kSumStride);
    _tile_loadd(1, sums + 16, kSumStride);
    _tile_loadd(2, sums + 32, kSumStride);
    _tile_loadd(3, sums + 48, kSumStride);
  }
  for (int64_t pair = begin; pair < end; pair += kTilePairs) {
    const auto* w = reinterpret_cast<const char*>(panel) + pair * kPanelRow;
    if (streams) {  // the 4 KB this step's tiles read, kPrefetchAhead further on
      for (int64_t line = 0; line < kTilePairs * kPanelRow; line += 64) {
        _mm_prefetch(w + kPrefetchAhead + line, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, x + 2 * pair, x_stride);
    _tile_loadd(5, w, kPanelRow);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, w + 64, kPanelRow);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, w + 128, kPanelRow);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, w + 192, kPanelRow);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, sums, kSumStride);
  _tile_stored(1, sums + 16, kSumStride);
  _tile_stored(2, sums + 32, kSumStride);
  _tile_stored(3, sums + 48, kSumStride);
}

}  // namespace

bool has_amx_bf16() {
  static const bool available = probe_amx();
  return available;
}

void linear_bf16_amx(const void* x, const void* packed, const void* bias, void* out,
                     int64_t rows, int64_t in_features, int64_t out_features) {
  // Also what asks the OS for the tile state: a tile instruction before that is illegal.
  if (!has_amx_bf16()) throw std::runtime_error("this CPU or OS offers no AMX bfloat16 tiles");
  const int64_t num_pairs = in_features / 2;
  const int64_t num_panels = packed_bf16_panels(out_features);
  const int64_t num_groups = (rows + kTileRows - 1) / kTileRows;
  const auto* x_bits = static_cast<const uint16_t*>(x);
  const auto* weights = static_cast<const uint16_t*>(packed);
  const auto* bias_bits = static_cast<const uint16_t*>(bias);
  auto* y = static_cast<uint16_t*>(out);
  const int64_t x_stride = in_features * static_cast<int64_t>(sizeof(uint16_t));
  // The last group's rows, copied into a whole tile's room in a buffer of the calling thread's
  // (a decode step copies its one row instead of allocating a tile for every product). What
  // the rows past them hold does not matter: each row's sums depend on that row alone, and
  // only the first `rows` are written out.
  thread_local std::vector<uint16_t> padded;
  const int64_t tail_rows = rows - (num_groups - 1) * kTileRows;
  const uint16_t* last_group = x_bits + (num_groups - 1) * kTileRows * in_features;
  if (tail_rows < kTileRows) {
    if (padded.size() < static_cast<size_t>(kTileRows * in_features)) {
      padded.assign(static_cast<size_t>(kTileRows * in_features), 0);
    }
    std::memcpy(padded.data(), last_group, tail_rows * x_stride);
    last_group = padded.data();
  }
#pragma omp parallel
  {
    _tile_loadconfig(&detail::kTiles16x64);
    std::vector<float> sums(static_cast<size_t>(num_groups * kTileRows * kPanel));
#pragma omp for schedule(static)
    for (int64_t p = 0; p < num_panels; ++p) {
      const uint16_t* panel = weights + p * num_pairs * kPanel * 2;
      for (int64_t begin = 0; begin < num_pairs; begin += kPairBlock) {
        const int64_t end = std::min(begin + kPairBlock, num_pairs);
        for (int64_t g = 0; g < num_groups; ++g) {
          const uint16_t* group = g + 1 < num_groups ? x_bits + g * kTileRows * in_features
                                                     : last_group;
          add_block(group, x_stride, panel, begin, end, sums.data() + g * kTileRows * kPanel,
                    begin == 0, g == 0);
        }
      }
      const int64_t first = p * kPanel;
      const int64_t width = std::min(kPanel, out_features - first);
      for (int64_t r = 0; r < rows; ++r) {
        round_sums_bf16(sums.data() + r * kPanel, bias_bits == nullptr ? nullptr
                                                                       : bias_bits + first,
                        y + r * out_features + first, width);
      }
    }
    _tile_release();
  }
}

}  // namespace sssd::kernels
