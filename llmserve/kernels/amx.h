// What the kernels that use AMX tiles share: whether this build has them, the OS's permission, the tile
// configuration's layout.
#pragma once

#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define LLMSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace llmserve_amx {

// Linux hands out the AMX register state only on request, once per process.
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// ldtilecfg's 64-byte operand (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace llmserve_amx
#endif
