/* AMX tile set-up shared by the kernels that use the tiles (attention, the peak). */
#ifndef CSA_AMX_H
#define CSA_AMX_H
#include "csa.h"

#ifdef CSA_HAVE_AMX
#include <immintrin.h>
#include <string.h>

/* Configures eight tiles of 16 rows x 64 bytes (palette 1) for the calling thread:
 * every thread that runs tile instructions does this first and _tile_release()s after. */
__attribute__((target("amx-tile"))) static inline void csa_amx_tiles_16x64(void)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}
#endif
#endif
