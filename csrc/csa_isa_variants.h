/* Compiles the tuned kernel body in CSA_IMPL once per ISA level, the way NumPy's
 * dispatch sources do, so one portable build carries AVX2 and AVX-512 paths and
 * picks one at run time (csa.h: CSA_DISPATCH).  Inside CSA_IMPL, name every function
 * CSA_V(name) and make it static.  No include guard: it is meant to be included
 * once per kernel file, after `#define CSA_IMPL "xxx_impl.h"`. */

#define CSA_V(name) name##_base
#include CSA_IMPL
#undef CSA_V

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define CSA_V(name) name##_avx2
#include CSA_IMPL
#undef CSA_V
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,prefer-vector-width=512")
#define CSA_V(name) name##_avx512
#include CSA_IMPL
#undef CSA_V
#pragma GCC pop_options
#else
/* No x86 variants: the higher levels fall back to the baseline build. */
#define CSA_V(name) name##_avx2
#include CSA_IMPL
#undef CSA_V
#define CSA_V(name) name##_avx512
#include CSA_IMPL
#undef CSA_V
#endif
