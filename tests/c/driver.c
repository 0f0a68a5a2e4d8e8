/* C test driver: every tuned kernel against its scalar `_ref` oracle, at every ISA
 * level this build has and this CPU supports, plus a thread-count determinism check.
 * Plain C, no Python: links the kernel sources (the .c files of csrc/), not the glue.
 *
 *   make test-c            # host build
 *   make test-aarch64      # the same driver cross-built, run under qemu-aarch64
 *
 * For each case of the table at the bottom:
 *   1. the adapter's init builds the inputs (a fixed xorshift stream, odd sizes,
 *      NaN / inf where the kernel's header defines what they do);
 *   2. the oracle: the adapter's run at level 'ref' (csa_isa_set(CSA_ISA_REF) makes
 *      every public entry call its `_ref`);
 *   3. for every level from 'base' up to csa_isa_best(): run at 2 threads and compare
 *      with the oracle (bitwise where the contract says the levels agree bitwise or the
 *      inputs make every sum exact, else within the case's tolerance; NaN where the
 *      oracle has NaN, the same infinities, the same status code), then at 1 thread
 *      and compare with the 2-thread run BITWISE (csa.h: results never depend on the
 *      thread count);
 *   4. the adapter's optional check (an invariant inside one output, e.g. a prefill
 *      equals the same tokens streamed step by step, bitwise).
 * Every output buffer starts filled with a sentinel, so an element a tuned kernel
 * forgets to write shows up as a mismatch.
 *
 * Each kernel is reached through ONE adapter function (its `run`): a change of a C
 * entry point's signature touches that adapter only.  Adapters that call attention /
 * pooling entries: run_attn (csa_sparse_attn, csa_sparse_attn_bf16), run_attn_bwd
 * (csa_sparse_attn_backward), run_pool
 * (csa_gated_pool), run_pool_stream (csa_pool_prefill, csa_pool_step).
 *
 * Output: one line per failure, one summary line per case, and the closing line
 * "N passed, N failed"; the exit status is 1 when anything failed. */
#include "attn.h"
#include "csa.h"
#include "gemm.h"
#include "index.h"
#include "norm.h"
#include "pool.h"
#include "quant.h"
#include "rope.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ------------------------------------------------------------------ plumbing */

enum { T_F32, T_BF16, T_I32, T_U8 };
static const size_t type_size[] = {4, 2, 4, 1};

/* Input flags (each adapter reads the ones it knows). */
enum {
    F_BF16 = 1 << 0,      /* bfloat16 data (q/kv, x, kv+score+out, ...) */
    F_NAN = 1 << 1,       /* plant NaN / inf where the contract defines them */
    F_EXACT = 1 << 2,     /* small integer inputs: every sum exact, so bitwise at all levels */
    F_NOW = 1 << 3,       /* no weight / ape / mask (NULL) */
    F_OVERLAP = 1 << 4,   /* pooling with overlap */
    F_INVERSE = 1 << 5,   /* RoPE inverse */
    F_POSITION = 1 << 6,  /* top-k in position order (V4.1) */
    F_BADIDX = 1 << 7,    /* an index out of range: the call must fail, output untouched */
    F_W_BF16 = 1 << 8,    /* indexer weights in bfloat16 */
    F_SC_F32 = 1 << 9,    /* pooling: float32 scores with bfloat16 kv */
    F_EPI = 1 << 10,      /* pooling stream: norm + RoPE epilogue */
    F_GRAD_BF16 = 1 << 12, /* sparse_attn_backward: bfloat16 d(q), d(kv) */
    F_BF16_GEMM = 1 << 11, /* gemm the bf16 GEMM takes (docs/kernels.md s. 9): at level amx,
                            * and avx512 on a CPU with AVX512_BF16, its float32 sums run in
                            * its own order, so a bfloat16 output may be one ulp off */
    F_NARROW = 1 << 12,   /* FP4 index keys: exponents 126..128 with Gaussian q and w (the
                           * prescaled one-sum path, no exact sums) */
};

#define MAXBUF 12

typedef struct tcase tcase;
typedef struct {
    const char *name;
    int (*init)(tcase *c);                   /* inputs; sets out_n, out_type */
    int (*run)(const tcase *c, void *out);   /* the adapter: one call of the C entry */
    int (*check)(const tcase *c, const void *out); /* optional invariant, failures */
} kernel;

struct tcase {
    const kernel *k;
    long p[8];          /* sizes, meaning per kernel (see the table) */
    int flags;
    double rtol, atol;  /* vs the oracle; both 0: bitwise */
    const char *label;
    /* QAT cases: at most `flips` elements may miss rtol/atol, each by one grid step
     * of its rounding at most (flip_atol): a value within an ulp of a rounding
     * boundary that a level's pooled value (an ulp off the scalar one) sends the
     * other way.  0: none. */
    int flips;
    double flip_atol;
    /* filled by init */
    void *buf[MAXBUF];
    int nbuf;
    size_t out_n;
    int out_type;
    int expect;         /* expected status (CSA_OK unless F_BADIDX) */
};

static uint64_t rng_state;
static uint64_t rng_u64(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float rng_unit(void) { return (float)((rng_u64() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }
static float rng_normal(void) /* roughly N(0, 1): sum of 3 uniforms, scaled */
{
    return (rng_unit() + rng_unit() + rng_unit());
}
static long rng_int(long lo, long hi) { return lo + (long)(rng_u64() % (uint64_t)(hi - lo + 1)); }

static void *tc_alloc(tcase *c, size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    c->buf[c->nbuf++] = p;
    return p;
}
static float *tc_f32(tcase *c, size_t n, float amp)
{
    float *p = tc_alloc(c, n * 4);
    for (size_t i = 0; i < n; i++)
        p[i] = (c->flags & F_EXACT) ? (float)rng_int(-2, 2) : amp * rng_normal();
    return p;
}
static csa_bf16 *tc_bf16(tcase *c, size_t n, float amp)
{
    csa_bf16 *p = tc_alloc(c, n * 2);
    for (size_t i = 0; i < n; i++)
        p[i] = csa_f32_to_bf16((c->flags & F_EXACT) ? (float)rng_int(-2, 2) : amp * rng_normal());
    return p;
}
/* float32 or bfloat16 by `bf16` */
static void *tc_data(tcase *c, size_t n, int bf16, float amp)
{
    return bf16 ? (void *)tc_bf16(c, n, amp) : (void *)tc_f32(c, n, amp);
}
static void put(void *p, int bf16, size_t i, float v)
{
    if (bf16) ((csa_bf16 *)p)[i] = csa_f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

static void set_threads(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

static int n_pass, n_fail;

static float out_get(const void *o, int type, size_t i)
{
    return type == T_F32 ? ((const float *)o)[i] : csa_bf16_to_f32(((const csa_bf16 *)o)[i]);
}

/* Oracle comparison; prints the first few mismatches, returns their count. */
static size_t compare(const tcase *c, const void *ref, const void *got, const char *what,
                      int level)
{
    /* attn.h / index.h: at level amx the bfloat16 products run on tiles in another
     * summation order; every level stays within bf16 rounding of the others: two more
     * bf16 ulps there. */
    const double bf16_ulps = level >= CSA_ISA_AMX ? 3 : 1;
    size_t bad = 0;
    const size_t n = c->out_n;
    const int bf16_gemm = (c->flags & F_BF16_GEMM) && c->out_type == T_BF16 &&
                          (level >= CSA_ISA_AMX ||
                           (level == CSA_ISA_AVX512 && (csa_cpu_features() & CSA_CPU_BF16)));
    const int bitwise = c->rtol == 0 && c->atol == 0 && !bf16_gemm;
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        int ok;
        char detail[96];
        if (c->out_type == T_I32) {
            const int32_t a = ((const int32_t *)ref)[i], b = ((const int32_t *)got)[i];
            ok = a == b;
            snprintf(detail, sizeof detail, "%d vs oracle %d", (int)b, (int)a);
        } else if (c->out_type == T_U8) {
            const uint8_t a = ((const uint8_t *)ref)[i], b = ((const uint8_t *)got)[i];
            ok = a == b;
            snprintf(detail, sizeof detail, "%u vs oracle %u", b, a);
        } else {
            const float a = out_get(ref, c->out_type, i), b = out_get(got, c->out_type, i);
            if (bitwise) {
                const size_t es = type_size[c->out_type];
                ok = memcmp((const char *)ref + i * es, (const char *)got + i * es, es) == 0;
                /* any NaN payload is the same NaN */
                if (!ok && isnan(a) && isnan(b)) ok = 1;
            } else if (isnan(a) || isnan(b)) {
                ok = isnan(a) && isnan(b);
            } else if (isinf(a) || isinf(b)) {
                ok = a == b;
            } else {
                /* bfloat16 outputs: bf16 ulps of slack on top of the tolerance */
                const double tol = c->atol + c->rtol * fabs(a) +
                                   (c->out_type == T_BF16 ? fabs(a) * bf16_ulps / 128 : 0);
                const double e = fabs((double)a - b);
                ok = e <= tol;
                if (e / (tol > 0 ? tol : 1) > worst) worst = e / (tol > 0 ? tol : 1);
            }
            snprintf(detail, sizeof detail, "%.9g vs oracle %.9g", b, a);
        }
        if (!ok) {
            if (bad < 4) printf("    %s: element %zu: %s\n", what, i, detail);
            bad++;
        }
    }
    if (bad > 4) printf("    %s: ... %zu mismatches of %zu\n", what, bad, n);
    return bad;
}

/* compare(), with the case's budget of QAT code flips: the elements outside the
 * tolerance must be at most c->flips, each within c->flip_atol.  Returns the number
 * of elements beyond the budget. */
static size_t compare_flips(const tcase *c, const void *ref, const void *got, const char *what,
                            int level)
{
    const size_t bad = compare(c, ref, got, what, level);
    if (!bad || c->flips == 0) return bad;
    size_t far = 0;
    for (size_t i = 0; i < c->out_n; i++) {
        const float a = out_get(ref, c->out_type, i), b = out_get(got, c->out_type, i);
        if (!(fabs((double)a - b) <= c->flip_atol) && !(isnan(a) && isnan(b))) far++;
    }
    if (bad <= (size_t)c->flips && far == 0) {
        printf("    %s: %zu element(s) one rounding step off (budget %d)\n", what, bad, c->flips);
        return 0;
    }
    printf("    %s: %zu elements outside the tolerance (QAT flip budget %d), %zu beyond %g\n",
           what, bad, c->flips, far, c->flip_atol);
    return bad;
}

/* F_BADIDX: the call fails before writing, so the output still holds the sentinel. */
static int untouched(const void *o, size_t bytes)
{
    for (size_t i = 0; i < bytes; i++)
        if (((const unsigned char *)o)[i] != 0x7b) return 0;
    return 1;
}

static void fill_sentinel(void *o, size_t bytes) { memset(o, 0x7b, bytes); }

static void result(int ok, const tcase *c, const char *level, const char *what)
{
    if (ok) n_pass++;
    else {
        n_fail++;
        printf("FAIL %s [%s] level %s: %s\n", c->k->name, c->label, level, what);
    }
}

static void run_case(tcase *c)
{
    c->expect = CSA_OK;
    if (c->k->init(c)) {
        n_fail++;
        printf("FAIL %s [%s]: init\n", c->k->name, c->label);
        return;
    }
    if (c->flags & F_BADIDX) c->expect = CSA_EINDEX;
    const size_t bytes = c->out_n * type_size[c->out_type];
    void *ref = malloc(bytes ? bytes : 1), *o2 = malloc(bytes ? bytes : 1),
         *o1 = malloc(bytes ? bytes : 1);
    if (!ref || !o1 || !o2) exit(2);

    csa_isa_set(CSA_ISA_REF);
    set_threads(2);
    fill_sentinel(ref, bytes);
    int st = c->k->run(c, ref);
    result(st == c->expect, c, "ref", "status of the oracle");
    if (c->flags & F_BADIDX) result(untouched(ref, bytes), c, "ref", "output written on failure");
    if (c->k->check) result(c->k->check(c, ref) == 0, c, "ref", "invariant");

    char levels[64] = "";
    for (int l = CSA_ISA_BASE; l <= csa_isa_best(); l++) {
        const char *ln = csa_isa_name(l);
        csa_isa_set(l);
        set_threads(2);
        fill_sentinel(o2, bytes);
        const int s2 = c->k->run(c, o2);
        char what[64];
        snprintf(what, sizeof what, "status %d, oracle %d", s2, st);
        result(s2 == st, c, ln, what);
        if (c->flags & F_BADIDX) result(untouched(o2, bytes), c, ln, "output written on failure");
        result(compare_flips(c, ref, o2, "vs oracle", l) == 0, c, ln,
               c->rtol == 0 && c->atol == 0 ? "not bitwise equal to the oracle"
                                            : "outside the tolerance of the oracle");
        set_threads(1);
        fill_sentinel(o1, bytes);
        const int s1 = c->k->run(c, o1);
        result(s1 == s2 && memcmp(o1, o2, bytes) == 0, c, ln,
               "1 thread and 2 threads differ (must be bitwise equal)");
        if (c->k->check) result(c->k->check(c, o2) == 0, c, ln, "invariant");
        strcat(levels, " ");
        strcat(levels, ln);
    }
    printf("  %-16s %-40s ref vs%s\n", c->k->name, c->label, levels);
    csa_isa_set(CSA_ISA_REF);
    free(ref);
    free(o1);
    free(o2);
    for (int i = 0; i < c->nbuf; i++) free(c->buf[i]);
    c->nbuf = 0;
}

/* ------------------------------------------------------------------ RMSNorm
 * p: rows, d.  x rows are padded (row stride d + 3), out contiguous. */
static int init_norm(tcase *c)
{
    const long rows = c->p[0], d = c->p[1], bf = c->flags & F_BF16;
    tc_data(c, (size_t)rows * (d + 3), bf, 1.5f);   /* buf[0]: x */
    float *w = tc_f32(c, (size_t)d, 1.0f);           /* buf[1]: w */
    (void)w;
    c->out_n = (size_t)rows * d;
    c->out_type = bf ? T_BF16 : T_F32;
    return 0;
}
static int run_norm(const tcase *c, void *out)
{
    const long rows = c->p[0], d = c->p[1];
    const float *w = (c->flags & F_NOW) ? NULL : c->buf[1];
    if (c->flags & F_BF16)
        return csa_rms_norm_bf16(c->buf[0], rows, d, d + 3, 1, w, 1, 1e-6f, out, d, 1);
    return csa_rms_norm(c->buf[0], rows, d, d + 3, 1, w, 1, 1e-6f, out, d, 1);
}
static const kernel K_NORM = {"rms_norm", init_norm, run_norm, NULL};

/* ------------------------------------------------------------------ RoPE
 * p: n0, n1 (table rows), n2 (heads), half.  x [n0, n1, n2, 2*half + 5]: the rotated
 * part is a strided view (the head row is longer), rotated in place in out. */
static int init_rope(tcase *c)
{
    const long n0 = c->p[0], n1 = c->p[1], n2 = c->p[2], half = c->p[3];
    const int bf = c->flags & F_BF16;
    const long row = 2 * half + 5;
    tc_data(c, (size_t)n0 * n1 * n2 * row, bf, 2.0f);          /* buf[0]: x */
    float *cs = tc_alloc(c, (size_t)n1 * half * 4), *sn = tc_alloc(c, (size_t)n1 * half * 4);
    if (csa_rope_table(cs, sn, n1, 2 * half, 10000.0, 4096, 16.0, 32.0, 1.0)) return 1;
    c->out_n = (size_t)n0 * n1 * n2 * row;
    c->out_type = bf ? T_BF16 : T_F32;
    return 0;
}
static int run_rope(const tcase *c, void *out)
{
    const long n0 = c->p[0], n1 = c->p[1], n2 = c->p[2], half = c->p[3];
    const long row = 2 * half + 5;
    const int bf = c->flags & F_BF16, inv = (c->flags & F_INVERSE) != 0;
    memcpy(out, c->buf[0], c->out_n * (bf ? 2 : 4));
    const long s3 = 1, s2 = row, s1 = n2 * row, s0 = n1 * n2 * row;
    if (bf)
        return csa_apply_rope_bf16((csa_bf16 *)out + 5, n0, n1, n2, half, s0, s1, s2, s3,
                                   c->buf[1], half, 1, c->buf[2], half, 1, inv);
    return csa_apply_rope((float *)out + 5, n0, n1, n2, half, s0, s1, s2, s3, c->buf[1], half,
                          1, c->buf[2], half, 1, inv);
}
static const kernel K_ROPE = {"apply_rope", init_rope, run_rope, NULL};

/* ------------------------------------------------------------------ QAT rounding
 * p: rows, d, block, fmt, scale.  F_NAN: a block with a NaN, one with inf, one of
 * zeros, one past the e4m3 range, one of subnormal-sized values (quant.h defines
 * all of them: NaN / inf make the block NaN, the floors handle zeros). */
static int init_quant(tcase *c)
{
    const long rows = c->p[0], d = c->p[1], blk = c->p[2];
    const int bf = c->flags & F_BF16;
    void *x = tc_data(c, (size_t)rows * d, bf, 3.0f);
    if (c->flags & F_NAN) {
        for (long r = 0; r < rows; r += 3) {
            const long b0 = (r * 7 % (d / blk)) * blk;
            switch (r % 5) {
            case 0: put(x, bf, r * d + b0 + blk / 2, NAN); break;
            case 1: put(x, bf, r * d + b0, -INFINITY); break;
            case 2: for (long i = 0; i < blk; i++) put(x, bf, r * d + b0 + i, 0.0f); break;
            case 3: for (long i = 0; i < blk; i++) put(x, bf, r * d + b0 + i, 1e5f * rng_normal()); break;
            case 4: for (long i = 0; i < blk; i++) put(x, bf, r * d + b0 + i, 1e-39f * rng_normal()); break;
            }
        }
    }
    c->out_n = (size_t)rows * d;
    c->out_type = bf ? T_BF16 : T_F32;
    return 0;
}
static int run_quant(const tcase *c, void *out)
{
    const long rows = c->p[0], d = c->p[1], blk = c->p[2];
    const int fmt = (int)c->p[3], sc = (int)c->p[4];
    if (c->flags & F_BF16)
        return csa_quant_round_bf16(c->buf[0], rows, d, d, 1, blk, fmt, sc, out, d, 1);
    return csa_quant_round(c->buf[0], rows, d, d, 1, blk, fmt, sc, out, d, 1);
}
static const kernel K_QUANT = {"quant_round", init_quant, run_quant, NULL};

/* ------------------------------------------------------------------ Hadamard
 * p: rows, n (a power of two). */
static int init_had(tcase *c)
{
    const long rows = c->p[0], n = c->p[1];
    const int bf = c->flags & F_BF16;
    tc_data(c, (size_t)rows * n, bf, 1.0f);
    c->out_n = (size_t)rows * n;
    c->out_type = bf ? T_BF16 : T_F32;
    return 0;
}
static int run_had(const tcase *c, void *out)
{
    const long rows = c->p[0], n = c->p[1];
    const float scale = 1.0f / sqrtf((float)n);
    if (c->flags & F_BF16) return csa_hadamard_bf16(c->buf[0], rows, n, n, 1, scale, out, n, 1);
    return csa_hadamard(c->buf[0], rows, n, n, 1, scale, out, n, 1);
}
static const kernel K_HAD = {"hadamard", init_had, run_had, NULL};

/* ------------------------------------------------------------------ gated pooling
 * p: B, T, d, ratio.  F_BF16: kv, score and out bfloat16 (F_SC_F32: score float32);
 * F_NOW: no ape.  Row strides padded. */
static int init_pool(tcase *c)
{
    const long B = c->p[0], T = c->p[1], d = c->p[2], r = c->p[3];
    const long cd = ((c->flags & F_OVERLAP) ? 2 : 1) * d;
    const int kbf = (c->flags & F_BF16) != 0, sbf = kbf && !(c->flags & F_SC_F32);
    tc_data(c, (size_t)B * T * (cd + 1), kbf, 1.0f);   /* buf[0]: kv, row stride cd + 1 */
    tc_data(c, (size_t)B * T * (cd + 2), sbf, 2.0f);   /* buf[1]: score, row stride cd + 2 */
    tc_f32(c, (size_t)r * cd, 0.5f);                   /* buf[2]: ape */
    c->out_n = (size_t)B * (T / r) * d;
    c->out_type = kbf ? T_BF16 : T_F32;
    return 0;
}
static int run_pool(const tcase *c, void *out)
{
    const long B = c->p[0], T = c->p[1], d = c->p[2], r = c->p[3];
    const int ov = (c->flags & F_OVERLAP) != 0;
    const long cd = (ov ? 2 : 1) * d;
    const int kbf = (c->flags & F_BF16) != 0, sbf = kbf && !(c->flags & F_SC_F32);
    const float *ape = (c->flags & F_NOW) ? NULL : c->buf[2];
    const struct csa_pool_problem p = {
        .kv = c->buf[0], .skb = T * (cd + 1), .skt = cd + 1, .skf = 1,
        .score = c->buf[1], .ssb = T * (cd + 2), .sst = cd + 2, .ssf = 1,
        .ape = ape, .sar = cd, .saf = 1,
        .out = out, .sob = (T / r) * d, .sog = d, .sof = 1,
        .B = B, .T = T, .d = d, .ratio = r, .overlap = ov,
        .kv_bf16 = kbf, .sc_bf16 = sbf, .out_bf16 = kbf};
    return csa_gated_pool(&p);
}
static const kernel K_POOL = {"gated_pool", init_pool, run_pool, NULL};

/* ------------------------------------------------------------------ pooling stream
 * p: B, T, d, ratio, half (RoPE of the epilogue).  The output holds the prefill of
 * all T tokens, then the same tokens streamed one csa_pool_step at a time from a
 * fresh state (pool.h: bitwise equal), then the state after the prefill. */
static int init_pool_stream(tcase *c)
{
    const long B = c->p[0], T = c->p[1], d = c->p[2], r = c->p[3], half = c->p[4];
    const long cd = ((c->flags & F_OVERLAP) ? 2 : 1) * d;
    const int bf = (c->flags & F_BF16) != 0;
    tc_data(c, (size_t)B * T * cd, bf, 1.0f);    /* buf[0]: kv */
    tc_data(c, (size_t)B * T * cd, bf, 2.0f);    /* buf[1]: score */
    tc_f32(c, (size_t)r * cd, 0.5f);             /* buf[2]: ape */
    float *w = tc_f32(c, (size_t)d, 1.0f);       /* buf[3]: norm weight */
    (void)w;
    float *cs = tc_alloc(c, (size_t)T * half * 4), *sn = tc_alloc(c, (size_t)T * half * 4);
    if (csa_rope_table(cs, sn, T, 2 * half, 160000.0, 0, 1.0, 32.0, 1.0)) return 1;
    const size_t G = (size_t)(T / r), es = bf ? 2 : 4;
    /* prefill entries, stepped entries: [B, G, d] each, in the out dtype; then the
     * prefill's state (float32 kv, score of the open group), reinterpreted in the out
     * dtype's units (only compared, never read as numbers when bf16). */
    const size_t state = (size_t)B * r * cd * 2 * 4;
    c->out_n = (2 * (size_t)B * G * d * es + state) / es;
    c->out_type = bf ? T_BF16 : T_F32;
    return 0;
}
static int pool_state_new(const tcase *c, csa_pool_state *st)
{
    const long B = c->p[0], d = c->p[2], r = c->p[3];
    const int ov = (c->flags & F_OVERLAP) != 0;
    const long cd = (ov ? 2 : 1) * d;
    *st = (csa_pool_state){B, r, d, ov, calloc((size_t)B * r * cd, 4), calloc((size_t)B * r * cd, 4),
                           calloc((size_t)B * r * d, 4), calloc((size_t)B * r * d, 4),
                           calloc((size_t)B, 8)};
    return st->kv && st->score && st->prev_kv && st->prev_score && st->pos ? 0 : CSA_ENOMEM;
}
static void pool_state_free(csa_pool_state *st)
{
    free(st->kv);
    free(st->score);
    free(st->prev_kv);
    free(st->prev_score);
    free(st->pos);
}
static int run_pool_stream(const tcase *c, void *out)
{
    const long B = c->p[0], T = c->p[1], d = c->p[2], r = c->p[3], half = c->p[4];
    const int ov = (c->flags & F_OVERLAP) != 0, bf = (c->flags & F_BF16) != 0;
    const long cd = (ov ? 2 : 1) * d, G = T / r;
    const size_t es = bf ? 2 : 4;
    const csa_pool_epilogue ep = {bf, c->buf[3], 1e-6f, c->buf[4], c->buf[5], half, T, half,
                                  (int)c->p[5], d - 2 * half, 0};
    const csa_pool_epilogue *epp = (c->flags & F_EPI) ? &ep : NULL;
    char *o_pre = out, *o_step = o_pre + (size_t)B * G * d * es;
    char *o_state = o_step + (size_t)B * G * d * es;
    csa_pool_state st;
    int s = pool_state_new(c, &st);
    const struct csa_pool_problem pre = {
        .kv = c->buf[0], .skb = T * cd, .skt = cd, .skf = 1,
        .score = c->buf[1], .ssb = T * cd, .sst = cd, .ssf = 1,
        .ape = c->buf[2], .sar = cd, .saf = 1,
        .out = o_pre, .sob = G * d, .sog = d, .sof = 1,
        .B = B, .T = T, .d = d, .ratio = r, .overlap = ov,
        .kv_bf16 = bf, .sc_bf16 = bf, .out_bf16 = bf};
    if (!s)
        s = csa_pool_prefill(&st, &pre, epp);
    if (!s) {
        memcpy(o_state, st.kv, (size_t)B * r * cd * 4);
        memcpy(o_state + (size_t)B * r * cd * 4, st.score, (size_t)B * r * cd * 4);
    }
    pool_state_free(&st);
    if (s) return s;
    /* stepped: tokens gathered per step into [B, cd] rows */
    s = pool_state_new(c, &st);
    void *kv1 = malloc((size_t)B * cd * es), *sc1 = malloc((size_t)B * cd * es),
         *o1 = malloc((size_t)B * d * es);
    if (!kv1 || !sc1 || !o1) s = CSA_ENOMEM;
    for (long p = 0; p < T && !s; p++) {
        for (long b = 0; b < B; b++) {
            memcpy((char *)kv1 + b * cd * es, (const char *)c->buf[0] + (b * T + p) * cd * es, cd * es);
            memcpy((char *)sc1 + b * cd * es, (const char *)c->buf[1] + (b * T + p) * cd * es, cd * es);
        }
        int emitted = 0;
        const struct csa_pool_problem one = {
            .kv = kv1, .skb = cd, .skt = cd, .skf = 1,
            .score = sc1, .ssb = cd, .sst = cd, .ssf = 1,
            .ape = c->buf[2], .sar = cd, .saf = 1,
            .out = o1, .sob = d, .sog = d, .sof = 1,
            .B = B, .T = 1, .d = d, .ratio = r, .overlap = ov,
            .kv_bf16 = bf, .sc_bf16 = bf, .out_bf16 = bf};
        s = csa_pool_step(&st, &one, p, epp, &emitted);
        if (!s && emitted)
            for (long b = 0; b < B; b++)
                memcpy(o_step + ((size_t)b * G + p / r) * d * es, (char *)o1 + b * d * es, d * es);
    }
    free(kv1);
    free(sc1);
    free(o1);
    pool_state_free(&st);
    return s;
}
static int check_pool_stream(const tcase *c, const void *out)
{
    const long B = c->p[0], T = c->p[1], d = c->p[2], r = c->p[3];
    const size_t n = (size_t)B * (T / r) * d * ((c->flags & F_BF16) ? 2 : 4);
    if (memcmp(out, (const char *)out + n, n) == 0) return 0;
    printf("    the prefill and the same tokens stepped differ\n");
    return 1;
}
static const kernel K_POOL_STREAM = {"pool_stream", init_pool_stream, run_pool_stream,
                                     check_pool_stream};

/* ------------------------------------------------------------------ indexer
 * p: B, S, Hi, Di, Tc, ratio, start_pos, K.  q, k float32 or bfloat16 (F_BF16), w
 * float32 or bfloat16 (F_W_BF16); q and k padded (strides not the dense ones).
 * F_NAN: a NaN in one key row (relu keeps NaN, NaN ranks above +inf). */
static int init_index(tcase *c)
{
    const long B = c->p[0], S = c->p[1], Hi = c->p[2], Di = c->p[3], Tc = c->p[4];
    const int bf = (c->flags & F_BF16) != 0, wbf = (c->flags & F_W_BF16) != 0;
    tc_data(c, (size_t)B * S * Hi * (Di + 4), bf, 1.0f);  /* buf[0]: q */
    void *k = tc_data(c, (size_t)B * Tc * (Di + 2), bf, 1.0f); /* buf[1]: k */
    tc_data(c, (size_t)B * S * Hi, wbf, 0.3f);             /* buf[2]: w */
    if (c->flags & F_NAN) put(k, bf, (size_t)(Tc / 3) * (Di + 2) + 1, NAN);
    /* buf[3]: the V4.1 candidate mask, blocks of 8 entries */
    const long nb = (Tc + 7) / 8;
    uint8_t *m = tc_alloc(c, (size_t)B * S * nb);
    for (long i = 0; i < B * S * nb; i++) m[i] = rng_u64() % 3 != 0;
    return 0;
}
static struct csa_index_problem index_problem(const tcase *c)
{
    const long B = c->p[0], S = c->p[1], Hi = c->p[2], Di = c->p[3], Tc = c->p[4];
    return (struct csa_index_problem){
        .q = c->buf[0], .k = c->buf[1], .w = c->buf[2],
        .qk_bf16 = (c->flags & F_BF16) != 0, .w_bf16 = (c->flags & F_W_BF16) != 0,
        .B = B, .S = S, .Hi = Hi, .Di = Di, .Tc = Tc,
        .sqb = S * Hi * (Di + 4), .sqs = Hi * (Di + 4), .sqh = Di + 4,
        .skb = Tc * (Di + 2), .skt = Di + 2,
        .swb = S * Hi, .sws = Hi, .swh = 1,
        .ratio = c->p[5], .start_pos = c->p[6]};
}
static int init_index_scores(tcase *c)
{
    init_index(c);
    c->out_n = (size_t)c->p[0] * c->p[1] * c->p[4];
    c->out_type = T_F32;
    return 0;
}
static int run_index_scores(const tcase *c, void *out)
{
    const struct csa_index_problem p = index_problem(c);
    return csa_index_scores(&p, out, p.S * p.Tc, p.Tc);
}
static const kernel K_INDEX_SCORES = {"index_scores", init_index_scores, run_index_scores, NULL};

static int init_index_topk(tcase *c)
{
    init_index(c);
    c->out_n = (size_t)c->p[0] * c->p[1] * c->p[7];
    c->out_type = T_I32;
    return 0;
}
static struct csa_index_cand index_cand(const tcase *c)
{
    const long S = c->p[1], Tc = c->p[4], nb = (Tc + 7) / 8;
    return (struct csa_index_cand){(c->flags & F_NOW) ? NULL : c->buf[3], nb, 8, S * nb, nb, 1};
}
static int run_index_topk(const tcase *c, void *out)
{
    const struct csa_index_problem p = index_problem(c);
    const struct csa_index_cand cand = index_cand(c);
    return csa_index_topk(&p, &cand, c->p[7], 5, (c->flags & F_POSITION) ? CSA_ORDER_POSITION
                                                                         : CSA_ORDER_SCORE, out);
}
/* index.h: csa_topk_indices on csa_index_scores' scores gives exactly the fused top-k,
 * at the same level: recompute both here and compare. */
static int check_index_topk(const tcase *c, const void *out)
{
    const struct csa_index_problem p = index_problem(c);
    const struct csa_index_cand cand = index_cand(c);
    const long K = c->p[7];
    float *sc = malloc((size_t)p.B * p.S * p.Tc * 4);
    int32_t *ix = malloc((size_t)p.B * p.S * K * 4);
    int bad = !sc || !ix;
    if (!bad) bad = csa_index_scores(&p, sc, p.S * p.Tc, p.Tc) != CSA_OK;
    if (!bad)
        bad = csa_topk_indices(sc, p.B, p.S, p.Tc, p.S * p.Tc, p.Tc, 1, p.ratio, p.start_pos, &cand,
                               K, 5, (c->flags & F_POSITION) ? CSA_ORDER_POSITION : CSA_ORDER_SCORE,
                               ix) != CSA_OK;
    if (!bad) bad = memcmp(ix, out, (size_t)p.B * p.S * K * 4) != 0;
    if (bad) printf("    index_topk differs from topk_indices(index_scores) at this level\n");
    free(sc);
    free(ix);
    return bad;
}
static const kernel K_INDEX_TOPK = {"index_topk", init_index_topk, run_index_topk,
                                    check_index_topk};

/* index.h, FP4 keys: k as uint8 rows of Di/2 + Di/32 bytes (row stride W + 3; buf[4]),
 * random codes and exponent bytes (F_EXACT: 126..128 with integer weights, every sum
 * exact; F_NARROW: 126..128; else 122..131; F_NAN: a NaN scale byte in row 3, row 5 at
 * 2^-127 and row 6 at 2^127, past the integer path's range); q float32 or bfloat16,
 * rounded to FP4 inside the kernel.  Same p as the float32 index cases.  The integer
 * path runs the oracle's float32 steps in its order: bitwise at every level. */
static int init_index_fp4(tcase *c)
{
    init_index(c);
    const long B = c->p[0], Tc = c->p[4], Di = c->p[3], W = Di / 2 + Di / 32;
    uint8_t *k = tc_alloc(c, (size_t)B * Tc * (W + 3));
    for (long r = 0; r < B * Tc; r++) {
        uint8_t *row = k + r * (W + 3);
        for (long i = 0; i < Di / 2; i++) row[i] = (uint8_t)rng_u64();
        for (long j = 0; j < Di / 32; j++)
            row[Di / 2 + j] = (uint8_t)((c->flags & (F_EXACT | F_NARROW)) ? rng_int(126, 128)
                                                                       : rng_int(122, 131));
    }
    if ((c->flags & F_NAN) && Tc > 6)
        for (long b = 0; b < B; b++) {
            uint8_t *k0 = k + b * Tc * (W + 3);
            k0[3 * (W + 3) + Di / 2] = 0xff;
            memset(k0 + 5 * (W + 3) + Di / 2, 0, (size_t)(Di / 32));
            memset(k0 + 6 * (W + 3) + Di / 2, 254, (size_t)(Di / 32));
        }
    return 0;
}
static struct csa_index_problem index_problem_fp4(const tcase *c)
{
    struct csa_index_problem p = index_problem(c);
    const long W = p.Di / 2 + p.Di / 32;
    p.k = c->buf[4];
    p.k_fp4 = 1;
    p.skb = p.Tc * (W + 3);
    p.skt = W + 3;
    return p;
}
static int init_index_scores_fp4(tcase *c)
{
    init_index_fp4(c);
    c->out_n = (size_t)c->p[0] * c->p[1] * c->p[4];
    c->out_type = T_F32;
    return 0;
}
static int run_index_scores_fp4(const tcase *c, void *out)
{
    const struct csa_index_problem p = index_problem_fp4(c);
    return csa_index_scores(&p, out, p.S * p.Tc, p.Tc);
}
static const kernel K_INDEX_SCORES_FP4 = {"index_scores fp4", init_index_scores_fp4,
                                          run_index_scores_fp4, NULL};
static int run_index_scores_fp4_b16(const tcase *c, void *out)
{
    struct csa_index_problem p = index_problem_fp4(c);
    p.bf16_steps = 1;
    return csa_index_scores(&p, out, p.S * p.Tc, p.Tc);
}
static const kernel K_INDEX_SCORES_FP4_B16 = {"index_scores fp4 bf16 steps",
                                              init_index_scores_fp4, run_index_scores_fp4_b16,
                                              NULL};
static int init_index_topk_fp4(tcase *c)
{
    init_index_fp4(c);
    c->out_n = (size_t)c->p[0] * c->p[1] * c->p[7];
    c->out_type = T_I32;
    return 0;
}
static int run_index_topk_fp4(const tcase *c, void *out)
{
    const struct csa_index_problem p = index_problem_fp4(c);
    const struct csa_index_cand cand = index_cand(c);
    return csa_index_topk(&p, &cand, c->p[7], 5, (c->flags & F_POSITION) ? CSA_ORDER_POSITION
                                                                         : CSA_ORDER_SCORE, out);
}
static const kernel K_INDEX_TOPK_FP4 = {"index_topk fp4", init_index_topk_fp4, run_index_topk_fp4,
                                        NULL};

/* ------------------------------------------------------------------ top-k of scores
 * p: B, S, Tc, ratio, start_pos, K.  Scores from few values (many ties), with
 * F_NAN: NaN, +-inf, -0.0 and +0.0 (index.h defines their ranking). */
static int init_topk(tcase *c)
{
    const long B = c->p[0], S = c->p[1], Tc = c->p[2];
    float *sc = tc_alloc(c, (size_t)B * S * (Tc + 3) * 4);   /* row stride Tc + 3 */
    static const float special[] = {NAN, INFINITY, -INFINITY, -0.0f, 0.0f};
    for (long i = 0; i < B * S * (Tc + 3); i++) {
        sc[i] = (float)rng_int(-6, 6) * 0.25f;
        if ((c->flags & F_NAN) && rng_u64() % 9 == 0) sc[i] = special[rng_u64() % 5];
    }
    const long nb = (Tc + 7) / 8;
    uint8_t *m = tc_alloc(c, (size_t)B * S * nb);
    for (long i = 0; i < B * S * nb; i++) m[i] = rng_u64() % 4 != 0;
    c->out_n = (size_t)B * S * c->p[5];
    c->out_type = T_I32;
    return 0;
}
static int run_topk(const tcase *c, void *out)
{
    const long B = c->p[0], S = c->p[1], Tc = c->p[2], nb = (Tc + 7) / 8;
    const struct csa_index_cand cand = {(c->flags & F_NOW) ? NULL : c->buf[1], nb, 8, S * nb, nb, 1};
    return csa_topk_indices(c->buf[0], B, S, Tc, S * (Tc + 3), Tc + 3, 1, c->p[3], c->p[4], &cand,
                            c->p[5], 0, (c->flags & F_POSITION) ? CSA_ORDER_POSITION
                                                                : CSA_ORDER_SCORE, out);
}
static const kernel K_TOPK = {"topk_indices", init_topk, run_topk, NULL};

/* ------------------------------------------------------------------ sparse attention
 * p: B, S, H, D, N, K.  q [B, S, H, D] with padded head rows, kv [B, N, D] padded,
 * idx with -1 slots, duplicates, and one query of only -1 (zeros).  F_NAN: NaN in one
 * kv row and one q row (attn.h: NaN propagates to the affected outputs); F_BADIDX:
 * one index = N (CSA_EINDEX, nothing written). */
static int init_attn(tcase *c)
{
    const long B = c->p[0], S = c->p[1], H = c->p[2], D = c->p[3], N = c->p[4], K = c->p[5];
    const int bf = (c->flags & F_BF16) != 0;
    void *q = tc_data(c, (size_t)B * S * H * (D + 3), bf, 1.0f);   /* buf[0]: q */
    void *kv = tc_data(c, (size_t)B * N * (D + 1), bf, 1.0f);      /* buf[1]: kv */
    float *sink = tc_f32(c, (size_t)H, 1.0f);                      /* buf[2]: sink */
    int32_t *idx = tc_alloc(c, (size_t)B * S * K * 4);              /* buf[3]: idx */
    for (long i = 0; i < B * S * K; i++) idx[i] = (int32_t)(rng_u64() % 5 == 0 ? -1 : rng_int(0, N - 1));
    for (long k = 0; k < K; k++) idx[(S / 2) * K + k] = -1;          /* a query of only -1 */
    if (S > 2) idx[2 * K + 1] = idx[2 * K];                            /* a duplicate */
    if (c->flags & F_NAN) {
        put(kv, bf, (size_t)idx[K + 3 < B * S * K ? K + 3 : 0] * (D + 1) + 2, NAN);
        put(q, bf, (size_t)(S - 1) * H * (D + 3) + (D + 3) + 1, NAN);
        sink[0] = 30.0f; /* a sink far above the logits */
    }
    if (c->flags & F_BADIDX) idx[B * S * K - 2] = (int32_t)N;
    c->out_n = (size_t)B * S * H * D;
    c->out_type = bf ? T_BF16 : T_F32;
    return 0;
}
static int run_attn(const tcase *c, void *out)
{
    const long B = c->p[0], S = c->p[1], H = c->p[2], D = c->p[3], N = c->p[4], K = c->p[5];
    const float scale = 1.0f / sqrtf((float)D);
    const struct csa_attn_problem p = {
        .q = c->buf[0], .sq_b = S * H * (D + 3), .sq_s = H * (D + 3), .sq_h = D + 3,
        .kv = c->buf[1], .skv_b = N * (D + 1), .skv_n = D + 1,
        .sink = c->buf[2], .idx = c->buf[3], .si_b = S * K, .si_s = K,
        .out = out, .so_b = S * H * D, .so_s = H * D, .so_h = D,
        .B = B, .S = S, .H = H, .D = D, .N = N, .K = K, .scale = scale,
        .bf16 = (c->flags & F_BF16) != 0};
    return csa_sparse_attn(&p);
}
static const kernel K_ATTN = {"sparse_attn", init_attn, run_attn, NULL};

/* ------------------------------------------------------------------ sparse_attn_backward
 * p: B, S, H, D, N, K; the inputs of init_attn (F_BF16: q, kv, out and grad_out
 * bfloat16), out / lse from the oracle's forward, grad_out [B, S, H, D] with padded head
 * rows.  The output is d(q) [B, S, H, D], then d(kv) [B, N, D], then (float32 results
 * only) d(sink) [H]; F_GRAD_BF16: d(q), d(kv) in bfloat16. */
static int init_attn_bwd(tcase *c)
{
    if (init_attn(c)) return 1;
    const long B = c->p[0], S = c->p[1], H = c->p[2], D = c->p[3], N = c->p[4];
    const int bf = (c->flags & F_BF16) != 0;
    void *o = tc_alloc(c, (size_t)B * S * H * D * (bf ? 2 : 4));        /* buf[4]: out */
    float *lse = tc_alloc(c, (size_t)B * S * H * 4);                     /* buf[5]: lse */
    tc_data(c, (size_t)B * S * H * (D + 2), bf, 1.0f);                   /* buf[6]: dout */
    struct csa_attn_problem p = {
        .q = c->buf[0], .sq_b = S * H * (D + 3), .sq_s = H * (D + 3), .sq_h = D + 3,
        .kv = c->buf[1], .skv_b = N * (D + 1), .skv_n = D + 1,
        .sink = c->buf[2], .idx = c->buf[3], .si_b = S * c->p[5], .si_s = c->p[5],
        .out = o, .so_b = S * H * D, .so_s = H * D, .so_h = D,
        .B = B, .S = S, .H = H, .D = D, .N = N, .K = c->p[5], .scale = 1.0f / sqrtf((float)D),
        .bf16 = bf, .lse = lse, .sl_b = S * H, .sl_s = H};
    const int st = csa_sparse_attn_ref(&p);
    if (st != CSA_OK && !(c->flags & F_BADIDX)) return 1;
    const int gb = (c->flags & F_GRAD_BF16) != 0;
    c->out_n = (size_t)B * S * H * D + (size_t)B * N * D + (gb ? 0 : (size_t)H);
    c->out_type = gb ? T_BF16 : T_F32;
    return 0;
}
static int run_attn_bwd(const tcase *c, void *out)
{
    const long B = c->p[0], S = c->p[1], H = c->p[2], D = c->p[3], N = c->p[4], K = c->p[5];
    const int gb = (c->flags & F_GRAD_BF16) != 0;
    const size_t es = gb ? 2 : 4;
    float dsink[256];
    struct csa_attn_bwd_problem g = {
        .f = {.q = c->buf[0], .sq_b = S * H * (D + 3), .sq_s = H * (D + 3), .sq_h = D + 3,
              .kv = c->buf[1], .skv_b = N * (D + 1), .skv_n = D + 1,
              .sink = c->buf[2], .idx = c->buf[3], .si_b = S * K, .si_s = K,
              .out = c->buf[4], .so_b = S * H * D, .so_s = H * D, .so_h = D,
              .B = B, .S = S, .H = H, .D = D, .N = N, .K = K, .scale = 1.0f / sqrtf((float)D),
              .bf16 = (c->flags & F_BF16) != 0, .lse = c->buf[5], .sl_b = S * H, .sl_s = H},
        .dout = c->buf[6], .sdo_b = S * H * (D + 2), .sdo_s = H * (D + 2), .sdo_h = D + 2,
        .dq = out, .sdq_b = S * H * D, .sdq_s = H * D, .sdq_h = D,
        .dkv = (char *)out + (size_t)B * S * H * D * es, .sdkv_b = N * D, .sdkv_n = D,
        .dsink = gb ? dsink : (float *)out + (size_t)B * S * H * D + (size_t)B * N * D,
        .dout_bf16 = (c->flags & F_BF16) != 0, .dq_bf16 = gb, .dkv_bf16 = gb};
    if (H > 256) return CSA_EINVAL;
    return csa_sparse_attn_backward(&g);
}
static const kernel K_ATTN_BWD = {"sparse_attn_backward", init_attn_bwd, run_attn_bwd, NULL};

/* ------------------------------------------------------------------ fp8_gemm / fp4_gemm
 * p: M, N, K, weight format (CSA_W_E4M3 / CSA_W_E2M1), activation scales e8m0 (1) or
 * float32 (0).  a rows padded (stride K + 5), b rows padded by 3 bytes, weight scales
 * e8m0; F_BF16: bfloat16 output; F_NAN: NaN codes planted in a and b. */
static uint8_t gemm_code(int nan)
{
    uint8_t u = (uint8_t)rng_int(0, 255);
    if (!nan && (u & 0x7f) == 0x7f) u ^= 1;
    return u;
}
static int init_gemm(tcase *c)
{
    const long M = c->p[0], N = c->p[1], K = c->p[2], fp8 = c->p[3] == CSA_W_E4M3;
    const long KB = (K + 127) / 128, bw = fp8 ? K : K / 2;
    const long sr = fp8 ? KB : (K + 31) / 32, sn = fp8 ? (N + 127) / 128 : N;
    uint8_t *a = tc_alloc(c, (size_t)M * (K + 5));                 /* buf[0] */
    for (long i = 0; i < M * (K + 5); i++) a[i] = gemm_code(0);
    uint8_t *as8 = tc_alloc(c, (size_t)M * KB);                    /* buf[1] */
    float *asf = tc_alloc(c, (size_t)M * KB * 4);                  /* buf[2] */
    for (long i = 0; i < M * KB; i++) {
        as8[i] = (uint8_t)rng_int(118, 130);
        asf[i] = (float)ldexp(0.5 + 0.5 * (rng_unit() * 0.5 + 0.5), (int)rng_int(-9, 3));
    }
    uint8_t *b = tc_alloc(c, (size_t)N * (bw + 3));                /* buf[3] */
    for (long i = 0; i < N * (bw + 3); i++) b[i] = fp8 ? gemm_code(0) : (uint8_t)rng_int(0, 255);
    uint8_t *bs = tc_alloc(c, (size_t)sn * sr);                    /* buf[4] */
    for (long i = 0; i < sn * sr; i++) bs[i] = (uint8_t)rng_int(118, 130);
    if (c->flags & F_NAN) {
        a[(M / 2) * (K + 5) + K / 3] = 0xff;
        if (fp8) b[(N - 1) * (bw + 3) + K - 1] = 0x7f;
    }
    c->out_n = (size_t)M * N;
    c->out_type = (c->flags & F_BF16) ? T_BF16 : T_F32;
    return 0;
}
static int run_gemm(const tcase *c, void *out)
{
    const long M = c->p[0], N = c->p[1], K = c->p[2], fp8 = c->p[3] == CSA_W_E4M3;
    const long KB = (K + 127) / 128, bw = fp8 ? K : K / 2, sr = fp8 ? KB : (K + 31) / 32;
    const int e8 = c->p[4] != 0;
    const struct csa_gemm_args g = {
        .a = c->buf[0], .M = M, .K = K, .sa_row = K + 5,
        .as = e8 ? c->buf[1] : c->buf[2], .as_fmt = e8 ? CSA_S_E8M0 : CSA_S_F32,
        .sas_row = KB, .sas_col = 1,
        .b = c->buf[3], .b_fmt = (int)c->p[3], .N = N, .sb_row = bw + 3,
        .bs = c->buf[4], .bs_fmt = CSA_S_E8M0, .sbs_row = sr, .sbs_col = 1,
        .out = out, .out_bf16 = (c->flags & F_BF16) != 0, .so_row = N,
    };
    return csa_gemm(&g);
}
static const kernel K_GEMM = {"gemm", init_gemm, run_gemm, NULL};

/* csa_gemm_batch: gemm's problem cut into problems of p[5] weight rows each (FP8: a
 * multiple of 128, the weight scales' rows), each with its slice of b, its scales and
 * its output columns -- and, unless p[6], of one activation row each (one-row problems
 * with different activations, run together); its output is the whole problem's. */
static int run_gemm_batch(const tcase *c, void *out)
{
    const long M = c->p[0], N = c->p[1], K = c->p[2], fp8 = c->p[3] == CSA_W_E4M3;
    const long KB = (K + 127) / 128, bw = fp8 ? K : K / 2, sr = fp8 ? KB : (K + 31) / 32;
    const long chunk = c->p[5], rows = c->p[6] ? M : 1;
    const int e8 = c->p[4] != 0, bf16 = (c->flags & F_BF16) != 0;
    struct csa_gemm_args g[64];
    int n = 0;
    for (long m = 0; m < M; m += rows)
        for (long n0 = 0; n0 < N; n0 += chunk) {
            if (n == 64) return CSA_EINVAL;   /* a table entry with too many problems */
            const uint8_t *as = e8 ? (const uint8_t *)c->buf[1] + m * KB
                                   : (const uint8_t *)c->buf[2] + m * KB * 4;
            g[n++] = (struct csa_gemm_args){
                .a = (const uint8_t *)c->buf[0] + m * (K + 5), .M = rows, .K = K,
                .sa_row = K + 5, .as = as, .as_fmt = e8 ? CSA_S_E8M0 : CSA_S_F32,
                .sas_row = KB, .sas_col = 1,
                .b = (const uint8_t *)c->buf[3] + n0 * (bw + 3), .b_fmt = (int)c->p[3],
                .N = N - n0 < chunk ? N - n0 : chunk, .sb_row = bw + 3,
                .bs = (const uint8_t *)c->buf[4] + (fp8 ? n0 / 128 : n0) * sr,
                .bs_fmt = CSA_S_E8M0, .sbs_row = sr, .sbs_col = 1,
                .out = (char *)out + (m * N + n0) * (bf16 ? 2 : 4), .out_bf16 = bf16, .so_row = N,
            };
        }
    return csa_gemm_batch(g, n);
}
static const kernel K_GEMM_BATCH = {"gemm_batch", init_gemm, run_gemm_batch, NULL};

/* csa_wfp8_gemm: p = M, G (groups; 0: none), K, N, weight scales e8m0, activations
 * bf16, bf16 weights (no scales).  Activations padded (group stride K + 3, row stride G (K + 3) + 1), weight
 * rows K + 3 bytes apart; F_NAN puts NaN codes in a full block and in the last. */
static int init_wgemm(tcase *c)
{
    const long M = c->p[0], G = c->p[1] > 0 ? c->p[1] : 1, K = c->p[2], N = c->p[3];
    const long KB = (K + 127) / 128;
    tc_data(c, (size_t)M * (G * (K + 3) + 1), c->p[5] != 0, 1.0f);   /* buf[0] */
    uint8_t *b;                                                        /* buf[1] */
    if (c->p[6]) {
        b = (uint8_t *)tc_bf16(c, (size_t)N * (K + 3), 1.0f);
    } else {
        b = tc_alloc(c, (size_t)N * (K + 3));
        for (long i = 0; i < N * (K + 3); i++) b[i] = gemm_code(0);
    }
    uint8_t *bs8 = tc_alloc(c, (size_t)((N + 127) / 128) * KB);        /* buf[2] */
    float *bsf = tc_alloc(c, (size_t)((N + 127) / 128) * KB * 4);      /* buf[3] */
    for (long i = 0; i < (N + 127) / 128 * KB; i++) {
        bs8[i] = (uint8_t)rng_int(118, 130);
        bsf[i] = (float)ldexp(0.5 + 0.5 * (rng_unit() * 0.5 + 0.5), (int)rng_int(-9, 3));
    }
    if ((c->flags & F_NAN) && !c->p[6]) {
        b[(N / 2) * (K + 3) + 5] = 0x7f;
        b[(N - 1) * (K + 3) + K - 1] = 0xff;
    }
    if ((c->flags & F_NAN) && c->p[6]) {
        ((csa_bf16 *)b)[(N / 2) * (K + 3) + 5] = 0x7fc0;
        ((csa_bf16 *)b)[(N - 1) * (K + 3) + K - 1] = 0xff80;   /* -inf */
    }
    c->out_n = (size_t)M * N;
    c->out_type = (c->flags & F_BF16) ? T_BF16 : T_F32;
    return 0;
}
static int run_wgemm(const tcase *c, void *out)
{
    const long M = c->p[0], G = c->p[1] > 0 ? c->p[1] : 1, K = c->p[2], N = c->p[3];
    const int e8 = c->p[4] != 0;
    const struct csa_wgemm_args g = {
        .a = c->buf[0], .a_bf16 = c->p[5] != 0, .M = M, .K = K,
        .sa_row = G * (K + 3) + 1, .sa_grp = K + 3, .ng_rows = c->p[1] > 0 ? N / G : 0,
        .b = c->buf[1], .b_bf16 = c->p[6] != 0, .N = N, .sb_row = (K + 3) * (c->p[6] ? 2 : 1),
        .bs = e8 ? c->buf[2] : c->buf[3], .bs_fmt = e8 ? CSA_S_E8M0 : CSA_S_F32,
        .sbs_row = (K + 127) / 128, .sbs_col = 1,
        .out = out, .out_bf16 = (c->flags & F_BF16) != 0, .so_row = N,
    };
    return csa_wfp8_gemm(&g);
}
static const kernel K_WGEMM = {"wfp8_gemm", init_wgemm, run_wgemm, NULL};

/* ------------------------------------------------------------------ the table */

#define BF F_BF16
static tcase cases[] = {
    /* rms_norm: rows, d */
    {&K_NORM, {37, 193}, 0, 2e-6, 1e-6, "f32 odd"},
    {&K_NORM, {64, 512}, F_NOW, 2e-6, 1e-6, "f32 no weight"},
    {&K_NORM, {5, 3}, 0, 2e-6, 1e-6, "f32 tiny"},
    {&K_NORM, {45, 201}, BF, 2e-6, 1e-6, "bf16 odd"},
    /* apply_rope: n0, n1, n2, half */
    {&K_ROPE, {2, 37, 3, 32}, 0, 1e-6, 1e-6, "f32 odd rows"},
    {&K_ROPE, {1, 64, 8, 7}, F_INVERSE, 1e-6, 1e-6, "f32 inverse half 7"},
    {&K_ROPE, {2, 33, 4, 32}, BF, 1e-6, 1e-6, "bf16"},
    /* quant_round: rows, d, block, fmt, scale */
    {&K_QUANT, {131, 448, 64, CSA_Q_E4M3, CSA_QS_UE8M0}, F_NAN, 0, 0, "e4m3 ue8m0 NaN/inf"},
    {&K_QUANT, {9, 384, 128, CSA_Q_E4M3, CSA_QS_FP32}, F_NAN, 0, 0, "e4m3 fp32 NaN/inf"},
    {&K_QUANT, {67, 96, 16, CSA_Q_E2M1, CSA_QS_E4M3}, F_NAN, 0, 0, "e2m1 e4m3 NaN/inf"},
    {&K_QUANT, {13, 96, 32, CSA_Q_E2M1, CSA_QS_UE8M0}, F_NAN, 0, 0, "e2m1 ue8m0 NaN/inf"},
    {&K_QUANT, {131, 448, 64, CSA_Q_E4M3, CSA_QS_UE8M0}, BF | F_NAN, 0, 0, "bf16 e4m3 NaN/inf"},
    {&K_QUANT, {21, 128, 32, CSA_Q_E2M1, CSA_QS_UE8M0}, BF | F_NAN, 0, 0, "bf16 e2m1"},
    /* hadamard: rows, n */
    {&K_HAD, {67, 128}, 0, 0, 0, "f32 n 128"},
    {&K_HAD, {5, 1024}, 0, 0, 0, "f32 n 1024"},
    {&K_HAD, {3, 2}, 0, 0, 0, "f32 n 2"},
    {&K_HAD, {7, 1}, 0, 0, 0, "f32 n 1"},
    {&K_HAD, {69, 256}, BF, 0, 0, "bf16 n 256"},
    /* gated_pool: B, T, d, ratio */
    {&K_POOL, {2, 35, 67, 4}, F_OVERLAP, 2e-6, 2e-6, "f32 overlap r4 odd"},
    {&K_POOL, {1, 1040, 128, 4}, F_OVERLAP, 2e-6, 2e-6, "f32 overlap r4 260 groups"},
    {&K_POOL, {2, 300, 64, 128}, 0, 2e-6, 2e-6, "f32 r128 no overlap"},
    {&K_POOL, {1, 21, 33, 1}, 0, 0, 0, "f32 r1 (copy)"},
    {&K_POOL, {2, 17, 19, 4}, F_OVERLAP | F_NOW, 2e-6, 2e-6, "f32 overlap no ape"},
    {&K_POOL, {2, 43, 67, 4}, F_OVERLAP | BF, 2e-6, 2e-6, "bf16 overlap"},
    {&K_POOL, {1, 259, 64, 128}, BF | F_SC_F32, 2e-6, 2e-6, "bf16 kv f32 score r128"},
    /* the AVX2 body's paths: two feature chunks (d > 1024) with a tail; row groups of
     * 8 + 2 and 8 + 4 candidates; logits not kept (r128 x d > the buffer) with a tail */
    {&K_POOL, {1, 9, 1100, 2}, 0, 2e-6, 2e-6, "f32 r2 d 1100 (two chunks)"},
    {&K_POOL, {2, 41, 45, 5}, F_OVERLAP | BF, 2e-6, 2e-6, "bf16 overlap r5 (10 rows)"},
    {&K_POOL, {1, 61, 23, 12}, BF | F_SC_F32, 2e-6, 2e-6, "bf16 kv f32 score r12"},
    {&K_POOL, {1, 260, 41, 128}, F_NOW, 2e-6, 2e-6, "f32 r128 d 41 no ape"},
    /* two candidates a feature: the AVX2 one-exp path */
    {&K_POOL, {2, 37, 29, 2}, BF, 2e-6, 2e-6, "bf16 r2 odd"},
    {&K_POOL, {1, 9, 13, 1}, F_OVERLAP, 2e-6, 2e-6, "f32 overlap r1 (2 candidates)"},
    /* pool_stream: B, T, d, ratio, half */
    {&K_POOL_STREAM, {2, 23, 64, 4, 8}, F_OVERLAP | F_EPI, 2e-6, 2e-6, "f32 overlap r4 norm+rope"},
    {&K_POOL_STREAM, {2, 261, 32, 128, 8}, F_EPI, 2e-6, 2e-6, "f32 r128 norm+rope"},
    {&K_POOL_STREAM, {3, 19, 64, 4, 16}, F_OVERLAP | F_EPI | BF, 2e-6, 2e-6, "bf16 overlap r4 norm+rope"},
    {&K_POOL_STREAM, {1, 9, 16, 1, 4}, F_EPI, 2e-6, 2e-6, "f32 r1 norm+rope"},
    /* p[5]: the epilogue's QAT rounding (enum csa_pool_quant).  Error budget: the
     * float tolerance of the other pool_stream cases (measured: every element equal
     * to the oracle's at every level here), plus QAT code flips: a level's pooled
     * value may differ from the scalar one in an ulp, which can move a rounded value
     * by one grid step -- at most 2 elements per case (0 measured), each by at most
     * 1 (fp8: the e4m3 step below 16) or 2 (FP4: the largest e2m1 step at unit
     * scale).  A tuned output of zeros, halved, or unrounded fails.  The
     * bitwise checks are prefill == stepped at each level and 1 == 2 threads. */
    {&K_POOL_STREAM, {2, 23, 128, 4, 32, CSA_POOL_Q_FP8}, F_OVERLAP | F_EPI, 2e-6, 2e-6, "f32 overlap r4 norm+rope+fp8", 2, 1},
    {&K_POOL_STREAM, {3, 19, 64, 4, 16, CSA_POOL_Q_HADAMARD_FP4}, F_OVERLAP | F_EPI | BF, 2e-6, 2e-6, "bf16 overlap r4 norm+rope+hadamard_fp4", 2, 2},
    {&K_POOL_STREAM, {2, 9, 64, 2, 8, CSA_POOL_Q_FP4_E4M3}, F_EPI, 2e-6, 2e-6, "f32 r2 norm+rope+fp4_e4m3", 2, 2},
    /* index_scores: B, S, Hi, Di, Tc, ratio, start_pos */
    {&K_INDEX_SCORES, {2, 9, 8, 67, 40, 4, 150}, 0, 1e-5, 1e-4, "f32 odd Di decode-ish"},
    {&K_INDEX_SCORES, {1, 64, 16, 128, 32, 4, 0}, 0, 1e-5, 1e-4, "f32 prefill causal"},
    {&K_INDEX_SCORES, {1, 33, 32, 128, 13, 4, 20}, F_EXACT, 0, 0, "f32 exact"},
    {&K_INDEX_SCORES, {1, 17, 16, 128, 40, 4, 100}, BF | F_W_BF16, 1e-5, 1e-4, "bf16 q/k/w"},
    {&K_INDEX_SCORES, {1, 17, 64, 64, 40, 4, 100}, BF | F_EXACT, 0, 0, "bf16 exact"},
    {&K_INDEX_SCORES, {1, 5, 8, 32, 20, 4, 60}, F_NAN, 1e-5, 1e-4, "f32 NaN key"},
    /* index_topk: B, S, Hi, Di, Tc, ratio, start_pos, K */
    {&K_INDEX_TOPK, {2, 9, 8, 64, 60, 4, 200, 16}, F_EXACT | F_NOW, 0, 0, "exact ties V4"},
    {&K_INDEX_TOPK, {1, 48, 16, 128, 24, 2, 0, 7}, F_EXACT | F_POSITION, 0, 0, "exact V4.1 mask prefill"},
    {&K_INDEX_TOPK, {1, 7, 8, 33, 50, 4, 170, 64}, F_EXACT | F_NAN, 0, 0, "exact NaN, K > visible"},
    {&K_INDEX_TOPK, {1, 13, 16, 64, 49, 4, 180, 9}, BF | F_EXACT | F_POSITION, 0, 0, "bf16 exact V4.1"},
    /* topk_indices: B, S, Tc, ratio, start_pos, K */
    /* index_scores / index_topk with FP4 keys: B, S, Hi, Di, Tc, ratio, start_pos (, K) */
    {&K_INDEX_SCORES_FP4, {2, 9, 64, 128, 40, 4, 150}, 0, 0, 0, "fp4 k decode-ish"},
    {&K_INDEX_SCORES_FP4, {1, 33, 17, 64, 13, 4, 20}, F_EXACT, 0, 0, "fp4 k exact odd heads"},
    {&K_INDEX_SCORES_FP4, {1, 40, 8, 32, 45, 1, 0}, BF | F_W_BF16, 0, 0, "fp4 k bf16 q/w prefill"},
    {&K_INDEX_TOPK_FP4, {2, 9, 16, 64, 60, 4, 200, 16}, F_EXACT | F_NOW, 0, 0, "fp4 k exact V4"},
    {&K_INDEX_TOPK_FP4, {1, 13, 16, 96, 49, 4, 180, 9}, F_EXACT | F_POSITION, 0, 0, "fp4 k exact V4.1 mask"},
    {&K_INDEX_SCORES_FP4, {1, 1, 64, 128, 300, 4, 1199}, F_NARROW, 0, 0, "fp4 k decode one-sum path"},
    {&K_INDEX_SCORES_FP4, {2, 8, 64, 128, 77, 4, 300}, 0, 0, 0, "fp4 k S=8 block path"},
    {&K_INDEX_SCORES_FP4_B16, {1, 1, 64, 128, 300, 4, 1199}, BF | F_W_BF16, 0, 0,
     "fp4 k bf16 steps decode"},
    {&K_INDEX_SCORES_FP4_B16, {2, 3, 20, 64, 45, 4, 170}, 0, 0, 0, "fp4 k bf16 steps 20 heads"},
    {&K_INDEX_SCORES_FP4_B16, {1, 1, 300, 64, 37, 1, 36}, F_NARROW, 0, 0,
     "fp4 k bf16 steps 300 heads"},
    {&K_INDEX_SCORES_FP4_B16, {1, 3, 9, 160, 41, 4, 160}, F_NAN, 0, 0, "fp4 k bf16 steps NaN"},
    {&K_INDEX_SCORES_FP4, {1, 3, 9, 160, 41, 4, 160}, F_NAN, 0, 0, "fp4 k NaN / range fallbacks"},
    {&K_INDEX_TOPK_FP4, {1, 1, 64, 128, 1000, 4, 3999, 512}, F_NARROW, 0, 0, "fp4 k decode top-512"},
    {&K_INDEX_TOPK_FP4, {2, 5, 32, 64, 90, 4, 350, 33}, F_NARROW | F_POSITION, 0, 0, "fp4 k V4.1 mask"},
    {&K_INDEX_TOPK_FP4, {1, 20, 16, 128, 40, 1, 0, 12}, F_NAN | F_NOW, 0, 0, "fp4 k prefill NaN"},
    {&K_TOPK, {2, 37, 70, 4, 100, 17}, F_NAN, 0, 0, "ties NaN inf -0 V4"},
    {&K_TOPK, {1, 64, 40, 4, 0, 9}, F_NAN | F_POSITION, 0, 0, "ties NaN prefill V4.1"},
    {&K_TOPK, {1, 5, 300, 1, 295, 64}, F_NOW, 0, 0, "ties ratio 1 no mask"},
    /* sparse_attn: B, S, H, D, N, K */
    {&K_ATTN, {1, 9, 16, 67, 200, 77}, 0, 1e-5, 1e-5, "f32 odd D"},
    {&K_ATTN, {2, 5, 64, 128, 300, 150}, F_NAN, 1e-5, 1e-5, "f32 NaN, sink far above"},
    {&K_ATTN, {1, 3, 8, 64, 50, 130}, 0, 1e-5, 1e-5, "f32 K > 2 blocks"},
    {&K_ATTN, {1, 7, 16, 64, 90, 40}, BF, 1e-5, 1e-5, "bf16"},
    {&K_ATTN, {1, 4, 16, 64, 90, 40}, BF | F_NAN, 1e-5, 1e-5, "bf16 NaN"},
    {&K_ATTN, {1, 4, 8, 32, 20, 9}, F_BADIDX, 0, 0, "index out of range"},
    /* sparse_attn_backward: B, S, H, D, N, K (tolerance: float32 sums of up to K H terms
     * in the tuned tiles' orders against the oracle's loop order) */
    {&K_ATTN_BWD, {1, 9, 16, 67, 200, 77}, 0, 1e-4, 1e-4, "f32 odd D"},
    {&K_ATTN_BWD, {2, 21, 20, 40, 30, 150}, 0, 1e-4, 1e-4, "f32 K > 2 blocks, chunks"},
    {&K_ATTN_BWD, {1, 7, 16, 64, 90, 40}, BF, 1e-4, 1e-4, "bf16 inputs"},
    {&K_ATTN_BWD, {1, 7, 16, 70, 90, 40}, BF | F_GRAD_BF16, 1e-4, 1e-4, "bf16 in, bf16 grads"},
    {&K_ATTN_BWD, {1, 4, 8, 32, 20, 9}, F_BADIDX, 0, 0, "index out of range"},
    /* gemm: M, N, K, weight format, activation scales e8m0 */
    {&K_GEMM, {1, 301, 1024, CSA_W_E4M3, 1}, 0, 0, 0, "fp8 decode M=1"},
    {&K_GEMM, {1, 130, 160, CSA_W_E4M3, 0}, F_NAN, 0, 0, "fp8 M=1 NaN codes"},
    {&K_GEMM, {7, 67, 400, CSA_W_E4M3, 1}, F_BF16, 0, 0, "fp8 M=7 bf16 out"},
    {&K_GEMM, {70, 129, 264, CSA_W_E4M3, 0}, 0, 0, 0, "fp8 prefill odd"},
    {&K_GEMM, {1, 257, 4096, CSA_W_E2M1, 1}, 0, 0, 0, "fp4 decode M=1"},
    {&K_GEMM, {1, 9, 96, CSA_W_E2M1, 0}, F_NAN, 0, 0, "fp4 M=1 K=96 NaN act"},
    {&K_GEMM, {33, 65, 640, CSA_W_E2M1, 1}, F_BF16 | F_BF16_GEMM, 0, 0, "fp4 M=33 bf16 out"},
    {&K_GEMM, {200, 70, 272, CSA_W_E4M3, 1}, 0, 0, 0, "fp8 prefill 2 row tiles, K slices"},
    {&K_GEMM, {197, 40, 288, CSA_W_E2M1, 0}, F_BF16, 0, 0, "fp4 prefill 2 row tiles, K slices"},
    {&K_GEMM, {1, 13, 96, CSA_W_E2M1, 0}, 0, 0, 0, "fp4 decode N % 8, odd blocks"},
    /* gemm_batch: as gemm, then the weight rows of each problem, then 1: rows kept together */
    {&K_GEMM_BATCH, {3, 301, 1024, CSA_W_E4M3, 1, 128, 0}, 0, 0, 0, "fp8 decode, 9 one-row problems"},
    {&K_GEMM_BATCH, {2, 257, 512, CSA_W_E2M1, 0, 40, 0}, F_BF16, 0, 0, "fp4 decode, 14 one-row problems"},
    {&K_GEMM_BATCH, {3, 70, 160, CSA_W_E2M1, 1, 16, 1}, 0, 0, 0, "fp4 M=3, 5 problems one by one"},
    /* wfp8_gemm: M, groups, K, N, weight scales e8m0, bf16 activations */
    {&K_WGEMM, {1, 8, 512, 1024, 1, 1}, 0, 0, 0, "decode 8 groups bf16 act"},
    {&K_WGEMM, {3, 0, 300, 133, 0, 0}, F_BF16, 0, 0, "f32 act, f32 scales, bf16 out"},
    {&K_WGEMM, {2, 3, 257, 42, 1, 1}, F_NAN, 0, 0, "3 groups of 14 rows, NaN codes"},
    {&K_WGEMM, {1, 0, 17, 5, 1, 0}, 0, 0, 0, "K < 16"},
    {&K_WGEMM, {1, 0, 4096, 37, 0, 0, 1}, 0, 0, 0, "bf16 weights, f32 act"},
    {&K_WGEMM, {3, 0, 300, 130, 0, 1, 1}, F_NAN | F_BF16, 0, 0, "bf16 weights NaN / inf, bf16 out"},
};

int main(int argc, char **argv)
{
    const char *only = argc > 1 ? argv[1] : NULL;   /* optional: run one kernel by name */
    printf("deepseek_csa C driver: best ISA level %s, OpenMP %s\n", csa_isa_name(csa_isa_best()),
#ifdef _OPENMP
           "on (1 and 2 threads compared)"
#else
           "off (serial build: the thread check compares two serial runs)"
#endif
    );
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (only && strcmp(only, cases[i].k->name) != 0) continue;
        rng_state = 0x9e3779b97f4a7c15ull ^ (i * 0x2545f4914f6cdd1dull);
        run_case(&cases[i]);
    }
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}
