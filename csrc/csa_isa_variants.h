/* Compiles the tuned kernel body in CSA_IMPL once per ISA level, the way NumPy's
 * dispatch sources do, so one portable build carries AVX2 and AVX-512 paths and
 * picks one at run time (csa.h: CSA_DISPATCH).  Inside CSA_IMPL, name every function
 * CSA_V(name) and make it static.  No include guard: it is meant to be included
 * once per kernel file, after `#define CSA_IMPL "xxx_impl.h"`. */

#define CSA_V(name) name##_base
#include CSA_IMPL
#undef CSA_V

#if defined(CSA_X86_VARIANTS)
/* clang: the feature macros GCC's target pragma would define in the region (only
 * those the build's own flags did not define already; undone after). */
#if defined(__clang__)
#ifndef __AVX2__
#define CSA_CLANG_AVX2 1
#endif
#ifndef __AVX512F__
#define CSA_CLANG_AVX512 1
#endif
#endif

CSA_TARGET_PUSH("avx2,fma,f16c")
#ifdef CSA_CLANG_AVX2
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#endif
#define CSA_V(name) name##_avx2
#include CSA_IMPL
#undef CSA_V
CSA_TARGET_POP

CSA_TARGET_PUSH512(CSA_TARGET_AVX512)
#ifdef CSA_CLANG_AVX512
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
#endif
#define CSA_V(name) name##_avx512
#include CSA_IMPL
#undef CSA_V
CSA_TARGET_POP

#ifdef CSA_CLANG_AVX2
#undef __AVX2__
#undef __FMA__
#undef __F16C__
#undef CSA_CLANG_AVX2
#endif
#ifdef CSA_CLANG_AVX512
#undef __AVX512F__
#undef __AVX512BW__
#undef __AVX512DQ__
#undef __AVX512VL__
#undef CSA_CLANG_AVX512
#endif
#else
/* No x86 variants (another architecture, or clang with OpenMP: csa.h): the higher
 * levels fall back to the baseline build (never selected: csa_isa_best() is base). */
#define CSA_V(name) name##_avx2
#include CSA_IMPL
#undef CSA_V
#define CSA_V(name) name##_avx512
#include CSA_IMPL
#undef CSA_V
#endif
