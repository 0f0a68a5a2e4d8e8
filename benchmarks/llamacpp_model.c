/* llama.cpp's whole-model runtime (libllama's C API) for benchmarks/bench_llamacpp_model.py
 * (issue 27 items 3-4).  Compiled by benchmarks/build_llamacpp.sh against the libllama it
 * builds under build/peers/ (never part of the package).  Token ids in, no tokenizer.
 *
 *   llamacpp_model logits MODEL THREADS PROMPT_IDS N_STEPS OUT [FORCED_IDS]
 *       decodes the prompt (one llama_decode; llama.cpp splits it into n_ubatch = 512
 *       physical batches), then N_STEPS single-token steps; writes to OUT the float32
 *       logits after the prompt and after each step ((N_STEPS + 1) x n_vocab).  The token
 *       fed at each step is FORCED_IDS[i] when given (teacher forcing), else the argmax.
 *       PROMPT_IDS / FORCED_IDS are files of whitespace-separated ids.
 *   llamacpp_model bench MODEL THREADS N_PROMPT N_DECODE ROUNDS
 *       ROUNDS times (after one warm-up of 64 + 4 tokens): clear the memory, decode a
 *       prompt of N_PROMPT deterministic pseudo-random ids, then N_DECODE greedy steps;
 *       prints one JSON line per round {prefill_s, decode_s, ...} and, at the end, the
 *       process's peak resident memory (VmHWM).  LLAMACPP_SWEEP_MIB=M: each step is
 *       timed alone, after an untimed pass over M MiB that evicts the L3 ("cold" steps).
 * Context: n_ctx = prompt + steps + 16, n_batch 2048, n_ubatch 512 (llama.cpp's
 * defaults), flash attention as llama.cpp chooses (auto), K/V cache F16 (default),
 * n_threads = n_threads_batch = THREADS. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-backend.h"
#include "llama.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* CPU seconds of the whole process (every thread): beside the wall time on a shared host */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int log_level = GGML_LOG_LEVEL_WARN;   /* LLAMACPP_LOG=info: llama.cpp's INFO lines too */

static void quiet(enum ggml_log_level level, const char *text, void *ud) {
    (void)ud;
    if (level >= log_level || level == GGML_LOG_LEVEL_CONT) fputs(text, stderr);
}

static int read_ids(const char *path, llama_token **out) {
    FILE *f = fopen(path, "r");
    if (!f) { perror(path); exit(2); }
    int cap = 1024, n = 0, v;
    llama_token *ids = malloc(cap * sizeof *ids);
    while (fscanf(f, "%d", &v) == 1) {
        if (n == cap) ids = realloc(ids, (cap *= 2) * sizeof *ids);
        ids[n++] = v;
    }
    fclose(f);
    *out = ids;
    return n;
}

static struct llama_context *open_ctx(struct llama_model *model, int n_ctx, int threads) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.no_perf = 1;
    /* diagnostics for the cross-engine row: LLAMACPP_KV=f32 (K/V cache type, default
       F16), LLAMACPP_FA=0|1 (flash attention off / on, default auto) */
    const char *kv = getenv("LLAMACPP_KV"), *fa = getenv("LLAMACPP_FA");
    if (kv && !strcmp(kv, "f32")) { cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32; }
    if (fa && *fa) cp.flash_attn_type = atoi(fa) ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                                                 : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "llama_init_from_model failed\n"); exit(3); }
    return ctx;
}

/* one read-modify-write pass over n words (every line of a buffer larger than the L3);
   the sum keeps the compiler from dropping it */
static uint64_t sweep_l3(uint64_t *buf, size_t n) {
    uint64_t s = 0;
    for (size_t i = 0; i < n; i += 8) s += ++buf[i];
    return s;
}

/* decode ids[0..n) in chunks of n_batch (2048) tokens; logits of the last token only */
static void decode(struct llama_context *ctx, llama_token *ids, int n) {
    for (int i = 0; i < n; i += 2048) {
        int m = n - i < 2048 ? n - i : 2048;
        int rc = llama_decode(ctx, llama_batch_get_one(ids + i, m));
        if (rc) { fprintf(stderr, "llama_decode returned %d\n", rc); exit(4); }
    }
}

static llama_token argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s logits MODEL THREADS PROMPT_IDS N_STEPS OUT [FORCED_IDS]\n"
                        "       %s bench MODEL THREADS N_PROMPT N_DECODE ROUNDS\n", argv[0], argv[0]);
        return 2;
    }
    const char *mode = argv[1], *path = argv[2];
    int threads = atoi(argv[3]);
    const char *lv = getenv("LLAMACPP_LOG");
    if (lv && !strcmp(lv, "info")) log_level = GGML_LOG_LEVEL_INFO;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    /* LLAMACPP_EXTRA_BUFTS=0: weights stay in plain CPU buffers (no CPU_REPACK / AMX) */
    const char *eb = getenv("LLAMACPP_EXTRA_BUFTS");
    if (eb && !strcmp(eb, "0")) mp.use_extra_bufts = 0;
    /* LLAMACPP_CPU_TENSORS=re1,re2: tensors matching these patterns go to the plain CPU
       buffer (the others may still go to CPU_REPACK / AMX) */
    static struct llama_model_tensor_buft_override ov[16];
    static char pats[1024];
    const char *ct = getenv("LLAMACPP_CPU_TENSORS");
    if (ct && *ct) {
        snprintf(pats, sizeof pats, "%s", ct);
        int k = 0;
        for (char *tok = strtok(pats, ","); tok && k < 15; tok = strtok(NULL, ","))
            ov[k++] = (struct llama_model_tensor_buft_override){tok, ggml_backend_cpu_buffer_type()};
        ov[k] = (struct llama_model_tensor_buft_override){NULL, NULL};
        mp.tensor_buft_overrides = ov;
    }
    double t0 = now();
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", path); return 3; }
    double t_load = now() - t0;
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    if (!strcmp(mode, "logits") && argc >= 7) {
        llama_token *prompt, *forced = NULL;
        int n = read_ids(argv[4], &prompt), steps = atoi(argv[5]), nf = 0;
        if (argc >= 8) nf = read_ids(argv[7], &forced);
        struct llama_context *ctx = open_ctx(model, n + steps + 16, threads);
        FILE *out = fopen(argv[6], "wb");
        if (!out) { perror(argv[6]); return 2; }
        decode(ctx, prompt, n);
        for (int s = 0; ; s++) {
            const float *lg = llama_get_logits_ith(ctx, -1);
            fwrite(lg, sizeof(float), n_vocab, out);
            if (s == steps) break;
            llama_token t = s < nf ? forced[s] : argmax(lg, n_vocab);
            decode(ctx, &t, 1);
        }
        fclose(out);
        llama_free(ctx);
    } else if (!strcmp(mode, "bench") && argc >= 7) {
        int n = atoi(argv[4]), steps = atoi(argv[5]), rounds = atoi(argv[6]);
        llama_token *ids = malloc((n > 64 ? n : 64) * sizeof *ids);
        unsigned s = 12345u;
        for (int i = 0; i < (n > 64 ? n : 64); i++) {
            s = s * 1103515245u + 12345u;
            ids[i] = 2 + (s >> 8) % (unsigned)(n_vocab - 2);
        }
        struct llama_context *ctx = open_ctx(model, n + steps + 16 > 96 ? n + steps + 16 : 96,
                                             threads);
        /* LLAMACPP_SWEEP_MIB=M: before each timed decode step (untimed) a pass over M MiB
           evicts the weights from the L3, as a model of many layers would find them */
        const char *sw = getenv("LLAMACPP_SWEEP_MIB");
        size_t sweep_n = sw && atol(sw) > 0 ? ((size_t)atol(sw) << 20) / 8 : 0;
        uint64_t *sweep = sweep_n ? calloc(sweep_n, 8) : NULL, sweep_sum = 0;
        if (sweep_n && !sweep) { fprintf(stderr, "cannot allocate the sweep\n"); return 3; }
        /* warm-up: 64 prompt tokens + 4 steps */
        decode(ctx, ids, 64);
        for (int i = 0; i < 4; i++) {
            llama_token t = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
            decode(ctx, &t, 1);
        }
        for (int r = 0; r < rounds; r++) {
            llama_memory_clear(llama_get_memory(ctx), 1);
            double a = now();
            decode(ctx, ids, n);
            llama_synchronize(ctx);
            double b = now(), cb = cpu_now(), dec = 0.0, dec_cpu = 0.0;
            if (!sweep) {
                for (int i = 0; i < steps; i++) {
                    llama_token t = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
                    decode(ctx, &t, 1);
                }
                llama_synchronize(ctx);
                dec = now() - b, dec_cpu = cpu_now() - cb;
            } else {
                for (int i = 0; i < steps; i++) {
                    sweep_sum += sweep_l3(sweep, sweep_n);   /* untimed */
                    double s0 = now(), c0 = cpu_now();
                    llama_token t = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
                    decode(ctx, &t, 1);
                    llama_synchronize(ctx);
                    dec += now() - s0, dec_cpu += cpu_now() - c0;
                }
            }
            printf("{\"round\": %d, \"n_prompt\": %d, \"n_decode\": %d, \"prefill_s\": %.6f, "
                   "\"decode_s\": %.6f, \"decode_cpu_s\": %.6f, \"load_s\": %.3f, "
                   "\"l3_sweep_mib\": %ld, \"sweep_sum\": %lu}\n", r, n,
                   steps, b - a, dec, dec_cpu, t_load, (long)(sweep_n * 8 >> 20),
                   (unsigned long)sweep_sum);
            fflush(stdout);
        }
        free(sweep);
        llama_free(ctx);
    } else {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    /* VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork + exec, so it would
       report the (large) Python parent that started us */
    long hwm_kb = -1;
    char line[256];
    FILE *st = fopen("/proc/self/status", "r");
    while (st && fgets(line, sizeof line, st))
        if (!strncmp(line, "VmHWM:", 6)) hwm_kb = atol(line + 6);
    if (st) fclose(st);
    printf("{\"peak_rss_bytes\": %ld, \"n_vocab\": %d}\n", hwm_kb * 1024L, n_vocab);
    llama_model_free(model);
    return 0;
}
