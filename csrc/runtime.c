/* ISA selection and thread counts shared by every kernel. */
#include "csa.h"

#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* AVX512_BF16, AVX512_VNNI, AVX512_VBMI and AMX-BF16 in the CPU, tile state enabled by the OS
 * (XCR0 bits 17 and 18), and on Linux the per-process permission to use it, which the kernel
 * grants once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without
 * it the first tile instruction would kill the process with SIGILL. */
static int amx_refused_ = 0;

static int amx_usable(void)
{
#if defined(CSA_HAVE_AMX) && defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int amx_tile = (d >> 24) & 1, amx_bf16 = (d >> 22) & 1;
    const int avx512_vnni = (c >> 11) & 1, avx512_vbmi = (c >> 1) & 1;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    const int avx512_bf16 = (a >> 5) & 1;
    if (!(amx_tile && amx_bf16 && avx512_bf16 && avx512_vnni && avx512_vbmi)) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0) return 1;
    amx_refused_ = 1;
    return 0;
#else
    return 0;
#endif
}

static int detect_best(void)
{
#if defined(CSA_X86_VARIANTS)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return amx_usable() ? CSA_ISA_AMX : CSA_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return CSA_ISA_AVX2;
#endif
    return CSA_ISA_BASE;
}

/* CPU features beyond a level's own that some AVX-512 paths use (csa.h); AVX-512
 * state saved by the OS is part of __builtin_cpu_supports' answer. */
static int cpu_features = -1;

int csa_cpu_features(void)
{
    if (cpu_features < 0) {
        int f = 0;
#if defined(CSA_X86_VARIANTS) && defined(CSA_HAVE_AMX)
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
            if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi"))
                f |= CSA_CPU_VNNI_VBMI;
            if (__builtin_cpu_supports("avx512bf16")) f |= CSA_CPU_BF16;
        }
        unsigned a, b, c, d; /* AMX-INT8 (CPUID 7.0 EDX bit 25), and tiles this process may use */
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1) && csa_isa_best() >= CSA_ISA_AMX)
            f |= CSA_CPU_AMX_INT8;
#endif
        /* DEEPSEEK_CSA_CPU_FEATURES=<names> keeps only the features named (vnni_vbmi,
         * bf16; "none" or empty keeps none): e.g. to test on a Zen 4 the paths an Ice
         * Lake takes.  It never adds a feature the CPU lacks. */
        const char *s = getenv("DEEPSEEK_CSA_CPU_FEATURES");
        if (s) {
            int keep = 0;
            if (strstr(s, "vnni_vbmi")) keep |= CSA_CPU_VNNI_VBMI;
            if (strstr(s, "bf16")) keep |= CSA_CPU_BF16;
            if (strstr(s, "amx_int8")) keep |= CSA_CPU_AMX_INT8;
            f &= keep;
        }
        cpu_features = f;
    }
    return cpu_features;
}

static int isa_best = -1;
static int isa_now = -1;

int csa_isa_best(void)
{
    if (isa_best < 0) isa_best = detect_best();
    return isa_best;
}

int csa_amx_refused(void)
{
    csa_isa_best();
    return amx_refused_;
}

static int level_from_env(void)
{
    /* DEEPSEEK_CSA_ISA=ref|base|avx2|avx512|amx caps the level (e.g. to test the
     * portable path on an AVX-512 machine). */
    const char *s = getenv("DEEPSEEK_CSA_ISA");
    int best = csa_isa_best();
    if (!s || !*s) return best;
    for (int l = CSA_ISA_REF; l <= CSA_ISA_AMX; l++)
        if (strcmp(s, csa_isa_name(l)) == 0) return l < best ? l : best;
    return best;
}

int csa_isa_get(void)
{
    if (isa_now < 0) isa_now = level_from_env();
    return isa_now;
}

int csa_isa_set(int level)
{
    int best = csa_isa_best();
    if (level < CSA_ISA_REF) level = CSA_ISA_REF;
    if (level > best) level = best;
    isa_now = level;
    return level;
}

const char *csa_isa_name(int level)
{
    switch (level) {
    case CSA_ISA_REF: return "ref";
    case CSA_ISA_BASE: return "base";
    case CSA_ISA_AVX2: return "avx2";
    case CSA_ISA_AVX512: return "avx512";
    case CSA_ISA_AMX: return "amx";
    default: return "unknown";
    }
}

int csa_threads(csa_idx items, csa_idx min_items)
{
#ifdef _OPENMP
    csa_idx nt = omp_get_max_threads();
#else
    csa_idx nt = 1;
#endif
    if (min_items < 1) min_items = 1;
    csa_idx cap = items / min_items;
    if (cap < nt) nt = cap;
    return nt < 1 ? 1 : (int)nt;
}
