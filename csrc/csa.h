/* Shared vocabulary of the deepseek_csa kernels: plain C, no Python.
 *
 * Every kernel takes pointers, sizes and strides counted in ELEMENTS (not bytes),
 * trusts that its caller validated them, and returns a csa_status.  Kernels never
 * abort and never print; the Python glue turns a status into an exception. */
#ifndef CSA_H
#define CSA_H

#include <stddef.h>
#include <stdint.h>

typedef ptrdiff_t csa_idx;

/* bfloat16 storage: the top 16 bits of a float32.  Kernels compute in float32 and
 * round to bfloat16 only where the reference does, always by csa_f32_to_bf16 (its
 * vector forms in bf16_impl.h): round to nearest-even; a NaN keeps its sign and the
 * top 7 bits of its payload and gets the quiet bit (0x0040), so it stays a NaN and
 * a quiet NaN keeps its bits; infinities and overflow to infinity behave as in IEEE
 * round-to-nearest.  That is the one float32 -> bfloat16 rule of the project (the
 * torch cast makes every NaN the canonical 0x7fc0 instead; the tests compare NaN
 * as NaN, never by payload). */
typedef uint16_t csa_bf16;

static inline float csa_bf16_to_f32(csa_bf16 h)
{
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline csa_bf16 csa_f32_to_bf16(float f)
{
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (csa_bf16)((v.u >> 16) | 0x40);
    return (csa_bf16)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#define CSA_RESTRICT __restrict__

/* Code compiled for an instruction set above the build's baseline, between
 * CSA_TARGET_PUSH("feature,feature") and CSA_TARGET_POP: GCC's `#pragma GCC target`
 * region; clang ignores that pragma, so there every function of the region gets
 * __attribute__((target(...))) through `#pragma clang attribute`.  GCC's pragma also
 * defines the feature macros (__AVX2__, __FMA__, ...) inside the region, which clang's
 * does not: csa_isa_variants.h defines the ones the bodies test.  GCC-only options of
 * CSA_TARGET_PUSH512 is the same region preferring 512-bit vectors (GCC's
 * prefer-vector-width=512, which clang's target attribute does not know; clang's
 * generic tuning already uses 512-bit vectors with AVX-512). */
#define CSA_PRAGMA(x) _Pragma(#x)
#define CSA_TARGET_AVX512 "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#if defined(__clang__)
#define CSA_TARGET_PUSH(t) \
    CSA_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define CSA_TARGET_PUSH512(t) CSA_TARGET_PUSH(t)
#define CSA_TARGET_POP CSA_PRAGMA(clang attribute pop)
#else
#define CSA_TARGET_PUSH(t) CSA_PRAGMA(GCC push_options) CSA_PRAGMA(GCC target(t))
#define CSA_TARGET_PUSH512(t) \
    CSA_PRAGMA(GCC push_options) CSA_PRAGMA(GCC target(t, "prefer-vector-width=512"))
#define CSA_TARGET_POP CSA_PRAGMA(GCC pop_options)
#endif

enum csa_status {
    CSA_OK = 0,
    CSA_ENOMEM = 1,   /* a scratch allocation failed */
    CSA_EINVAL = 2,   /* an argument the glue should have rejected */
    CSA_EINDEX = 3,   /* an index outside its range */
};

/* Instruction-set levels.  CSA_ISA_REF runs the plain scalar `_ref` kernels (the
 * oracle); the others run the tuned kernels compiled for that level. */
enum csa_isa {
    CSA_ISA_REF = 0,
    CSA_ISA_BASE = 1,    /* x86-64 baseline (SSE2) or whatever the compiler targets */
    CSA_ISA_AVX2 = 2,    /* AVX2 + FMA */
    CSA_ISA_AVX512 = 3,  /* AVX-512 F/BW/DQ/VL (and csa_cpu_features() where present) */
    CSA_ISA_AMX = 4,     /* AVX-512 + AVX512_BF16 / VNNI / VBMI + AMX-BF16 tiles the OS
                          * lets us use: the bfloat16 dot products of attention, the
                          * indexer and the GEMMs of more than 16 rows; with AMX-INT8
                          * (CSA_CPU_AMX_INT8) the FP4 indexer's integer dot products */
};

/* The tuned bodies are compiled once per x86 level (csa_isa_variants.h) with
 * per-function targets: on x86-64 with GCC, and with clang when it builds without
 * OpenMP.  clang (14 through 19 at least) does not give the functions it outlines from
 * an `omp parallel` region the target of the enclosing function, so vector code inside
 * such a region does not compile there; a clang OpenMP build therefore has the baseline
 * level only (as on other architectures): csa_isa_best() is 'base'. */
#if defined(__x86_64__) && defined(__GNUC__) && !(defined(__clang__) && defined(_OPENMP))
#define CSA_X86_VARIANTS 1
#endif

/* The compiler can build AMX-BF16 / AVX512_BF16 code (GCC >= 11, clang >= 12). */
#if defined(CSA_X86_VARIANTS) && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
                                  (defined(__clang__) && __clang_major__ >= 12))
#define CSA_HAVE_AMX 1
#endif

int csa_isa_best(void);       /* highest level this CPU supports */
int csa_isa_get(void);        /* level kernels dispatch to now */
int csa_isa_set(int level);   /* clamp to [REF, best], set, return the level set */
const char *csa_isa_name(int level);
/* Features some paths of the avx512 and amx levels take when the CPU has them (the
 * results are the same bits either way, or within the stated bound of the bf16 GEMM):
 * CSA_CPU_VNNI_VBMI, AVX512_VNNI + AVX512_VBMI: the one-row GEMMs (int8 dot products,
 * byte permutes); CSA_CPU_BF16, AVX512_BF16: the GEMMs of more rows on CPUs without AMX
 * tiles, and the one-row FP8 GEMM by bf16 dot products (docs/kernels.md section 9);
 * CSA_CPU_AMX_INT8, AMX-INT8 tiles the process may use (so only where csa_isa_best() is
 * amx): the FP4 indexer's integer dot products at level amx (docs/kernels.md section 4).
 * 0 where the compiler cannot build them; DEEPSEEK_CSA_CPU_FEATURES masks them (runtime.c). */
enum csa_cpu_feature { CSA_CPU_VNNI_VBMI = 1, CSA_CPU_BF16 = 2, CSA_CPU_AMX_INT8 = 4 };
int csa_cpu_features(void);
/* 1 when the CPU and the OS have AMX but the kernel refused this process the tile state
 * (arch_prctl ARCH_REQ_XCOMP_PERM failed): the levels stop at avx512, and the glue says so
 * once where a call would have used the tiles. */
int csa_amx_refused(void);

/* Threads for a parallel region over `items` independent output rows, so that each
 * thread gets at least `min_items` of them: min(omp_get_max_threads(), items/min_items),
 * at least 1.  omp_get_max_threads() follows OMP_NUM_THREADS, omp_set_num_threads and
 * so threadpoolctl.  Results never depend on it: regions split rows, never reductions. */
int csa_threads(csa_idx items, csa_idx min_items);

/* Pick the variant of a tuned kernel for the current ISA level; `ref_call` runs at
 * CSA_ISA_REF.  Each tuned kernel `name` exists as name_base, name_avx2, name_avx512
 * (see csa_isa_variants.h). */
#define CSA_DISPATCH(name, args, ref_call)                      \
    do {                                                        \
        switch (csa_isa_get()) {                                \
        case CSA_ISA_AMX:                                       \
        case CSA_ISA_AVX512: return name##_avx512 args;         \
        case CSA_ISA_AVX2: return name##_avx2 args;             \
        case CSA_ISA_BASE: return name##_base args;             \
        default: return ref_call;                               \
        }                                                       \
    } while (0)

#endif
