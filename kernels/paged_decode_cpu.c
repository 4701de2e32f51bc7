/* Paged decode attention on a CPU: one query per sequence over its paged KV, keys and values at 16 bits
 * (float32 storage) or packed 8/4/2-bit codes dequantized in registers, never materialised in full.
 *
 * Compiled on first use by `skistune.kernels.cpu_native` (cc -O3 -march=native -fopenmp) and called
 * through ctypes with the runtime's own tensors; the layouts are those of `skistune.runtime.kv_store`
 * and `skistune.kernels.quant`:
 *   16-bit side   data [NB, bs, n_kv, D] float32
 *   packed side   data [NB, bs, n_kv, D * bits / 8] uint8, channel c in byte c / per at bit (c % per) * bits
 *                 (per = 8 / bits); keys: scale, zero [NB, n_kv, D] (per channel over a block's tokens);
 *                 values: scale, zero [NB, bs, n_kv, D / group] (per token over `group` channels);
 *                 ring [slots, R, n_kv, D] float32 holds a running sequence's newest positions (p % R).
 * Positions >= fp_start[b] of a packed side are read from the ring (the full-precision window).
 *
 * Work is cut into chunks of a row's blocks (`CHUNK_BLOCKS`), spread over OpenMP threads (the OpenMP
 * runtime torch already loaded: the same libgomp, the same thread count), in three phases: the scores of
 * every chunk, the softmax of every (row, KV head) with its eviction statistics (`stats`: probabilities
 * summed over the G query heads of each KV head), then every chunk's share of the output, summed per row.
 * Chunks let one long sequence use every thread (split-K); within a chunk a token's row of every KV
 * head is read at once, because that row is contiguous and one head's rows are a page apart (16-bit
 * Llama-3-8B: 8 heads x 128 x 4 bytes), which made a head-at-a-time pass 3-5x slower (TLB misses).
 *
 * Packed keys: per block, the query is multiplied by the channel scales once (qs[c] = q[c] * scale[c],
 * qz = sum q[c] * zero[c]), so a token's score is qz + sum qs[c] * code[c]; the codes are unpacked into
 * a "deinterleaved" order (all low fields of the token's bytes, then the next field, ...) that needs no
 * shuffles, and qs is laid out in the same order. Packed values: the probability times the token's group
 * scale weights the unpacked codes of that group, and the zero points add once per group.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct {
    int32_t bits;        /* 16, or 8/4/2 (packed) */
    int32_t group;       /* values: channels per (scale, zero) group; keys: unused */
    const void *data;
    const float *scale;
    const float *zero;
    const float *ring;
} Side;

/* codes of one token's packed row (nb = D / per bytes), deinterleaved: out[k * nb + i] = field k of byte i */
static inline void unpack_row(const uint8_t *p, int nb, int bits, float *out) {
    switch (bits) {
    case 8:
#pragma omp simd
        for (int i = 0; i < nb; ++i) out[i] = (float)p[i];
        break;
    case 4:
#pragma omp simd
        for (int i = 0; i < nb; ++i) {
            out[i] = (float)(p[i] & 15);
            out[nb + i] = (float)(p[i] >> 4);
        }
        break;
    default: /* 2 */
#pragma omp simd
        for (int i = 0; i < nb; ++i) {
            out[i] = (float)(p[i] & 3);
            out[nb + i] = (float)((p[i] >> 2) & 3);
            out[2 * nb + i] = (float)((p[i] >> 4) & 3);
            out[3 * nb + i] = (float)(p[i] >> 6);
        }
    }
}

/* a . b. The reduction is where a dot of 64-128 elements spends its time: AVX-512 and AVX2 hosts use
 * vector registers and one horizontal sum (1.2-2x faster than portable code on a 16-bit step; a plain
 * `omp simd reduction` loop came out scalar in places: 128 dependent adds a dot); other hosts sum 16
 * independent partial sums as a tree. */
static inline float dot(const float *a, const float *b, int n) {
    int i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    float total = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#else
    float acc[16] = {0};
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
    float total = acc[0];
#endif
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
}

/* e^x for x <= 0 in float32 to about 1e-7 relative: 2^(x log2 e) split into 2^n (the exponent bits)
 * and 2^f, |f| <= 1/2, by its Taylor series to degree 7 (plain arithmetic: the loop that calls it
 * vectorises, where libm's expf is a call per element) */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float y = x * 1.44269504088896341f, n = floorf(y + 0.5f), f = (y - n) * 0.693147180559945309f;
    const float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120
                    + f * (1.0f / 720 + f * (1.0f / 5040)))))));
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

static inline void axpy(float *y, float a, const float *x, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

/* One row's blocks that hold kept positions ([first, L)), cut into chunks of CHUNK_BLOCKS: a task. */
typedef struct {
    int b, j0, j1;  /* sequence, blocks [j0, j1) */
} Chunk;

typedef struct {  /* a step's layout, shared by the phases */
    int B, H, n_kv, D, G, width, R, bs;
    float scale;
    const float *q;
    const int64_t *tables, *context_lens, *first_slots, *fp_start, *ring_slots;
    const Side *key, *value;
    float *scores;           /* per row b at offsets[b]: [H, n_b] with n_b = L - first */
    const int64_t *offsets;
} Step;

enum { CHUNK_BLOCKS = 16 };

static inline int row_first(const Step *st, int b) { return st->first_slots ? (int)st->first_slots[b] : 0; }
static inline int row_fp(const Step *st, int b) { return st->fp_start ? (int)st->fp_start[b] : (int)st->context_lens[b]; }

static inline const float *ring_row(const Side *side, const Step *st, int b, int t, int h) {
    const int64_t slot = st->ring_slots ? st->ring_slots[b] : 0;
    return side->ring + ((slot * st->R + t % st->R) * st->n_kv + h) * st->D;
}

/* [t0, t1) of block j clipped to the kept positions; the first position past the packed ones */
static inline void block_span(const Step *st, const Side *side, int b, int j, int *t0, int *t1, int *packed_end) {
    const int first = row_first(st, b), L = (int)st->context_lens[b], fp = row_fp(st, b), bs = st->bs;
    *t0 = j * bs > first ? j * bs : first;
    *t1 = (j + 1) * bs < L ? (j + 1) * bs : L;
    *packed_end = side->bits == 16 ? *t0 : (*t1 < fp ? *t1 : (fp > *t0 ? fp : *t0));
}

/* Phase 1: scores of a chunk's positions for every query head, all heads of a token read together (a
 * token's row of every KV head is contiguous; one head's rows are a page apart at 16 bits). Inlined with
 * D a constant (`D_CASES`): loops over D then have no remainder, and 8-16x fewer instructions run. */
static inline __attribute__((always_inline)) void score_chunk_d(const Step *st, Chunk c, float *qs, float *qz,
                                                                float *codes, const int D) {
    const Side *key = st->key;
    const int G = st->G, n_kv = st->n_kv, H = st->H, b = c.b, bs = st->bs;
    const int per = key->bits == 16 ? 1 : 8 / key->bits, nb = D / per;
    const int first = row_first(st, b), n = (int)st->context_lens[b] - first;
    const float *q = st->q + (int64_t)b * H * D;
    float *scores = st->scores + st->offsets[b];
    for (int j = c.j0; j < c.j1; ++j) {
        const int64_t blk = st->tables[(int64_t)b * st->width + j];
        int t0, t1, packed_end;
        block_span(st, key, b, j, &t0, &t1, &packed_end);
        if (packed_end > t0) /* this block's channel scales folded into the queries (qs, qz per head) */
            for (int h = 0; h < n_kv; ++h) {
                const float *sc = key->scale + (blk * n_kv + h) * D, *z = key->zero + (blk * n_kv + h) * D;
                for (int g = 0; g < G; ++g) {
                    const float *qg = q + (h * G + g) * D;
                    float *out = qs + (h * G + g) * D;
                    for (int k = 0; k < per; ++k)  /* channel i * per + k goes to k * nb + i */
                        for (int i = 0; i < nb; ++i) out[k * nb + i] = qg[i * per + k] * sc[i * per + k];
                    qz[h * G + g] = dot(qg, z, D);
                }
            }
        for (int t = t0; t < t1; ++t)
            for (int h = 0; h < n_kv; ++h) {
                const int64_t row = (blk * bs + t % bs) * n_kv + h;
                float *out = scores + (int64_t)h * G * n + (t - first);
                if (t < packed_end) {
                    unpack_row((const uint8_t *)key->data + row * nb, nb, key->bits, codes);
                    for (int g = 0; g < G; ++g)
                        out[g * n] = st->scale * (qz[h * G + g] + dot(qs + (h * G + g) * D, codes, D));
                } else {
                    const float *k = key->bits == 16 ? (const float *)key->data + row * D : ring_row(key, st, b, t, h);
                    for (int g = 0; g < G; ++g) out[g * n] = st->scale * dot(q + (h * G + g) * D, k, D);
                }
            }
    }
}

/* Phase 2: softmax of one row's scores for one KV head's query heads, in place; their sum into stats */
static void softmax_head(const Step *st, int b, int h, float *stats, int stats_len) {
    const int first = row_first(st, b), n = (int)st->context_lens[b] - first, G = st->G;
    float *scores = st->scores + st->offsets[b] + (int64_t)h * G * n;
    for (int g = 0; g < G; ++g) {
        float *s = scores + g * n, m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
        for (int i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
#pragma omp simd reduction(+ : total)
        for (int i = 0; i < n; ++i) {
            s[i] = exp_nonpositive(s[i] - m);
            total += s[i];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int i = 0; i < n; ++i) s[i] *= inv;
    }
    if (stats) { /* [B, n_kv, stats_len]: probabilities summed over the G heads, zero where not kept */
        float *out = stats + ((int64_t)b * st->n_kv + h) * stats_len;
        memset(out, 0, sizeof(float) * stats_len);
        for (int g = 0; g < G; ++g) axpy(out + first, 1.0f, scores + g * n, n);
    }
}

/* Phase 3: a chunk's share of the output, sum over its positions of p * v, into part [H, D]. A packed
 * token's values are dequantized once (deinterleaved, like its codes) and weighted for the G heads into
 * acc_q, which is put back in channel order at the end. */
static inline __attribute__((always_inline)) void mix_chunk_d(const Step *st, Chunk c, float *part, float *acc_q,
                                                              float *row_values, float *codes, const int D) {
    const Side *value = st->value;
    const int G = st->G, n_kv = st->n_kv, H = st->H, b = c.b, bs = st->bs;
    const int per = value->bits == 16 ? 1 : 8 / value->bits, nb = D / per;
    const int n_groups = value->bits == 16 ? 1 : D / value->group, span = value->group / per;
    const int first = row_first(st, b), n = (int)st->context_lens[b] - first;
    const float *probs = st->scores + st->offsets[b];
    memset(part, 0, sizeof(float) * H * D);
    memset(acc_q, 0, sizeof(float) * H * D);
    for (int j = c.j0; j < c.j1; ++j) {
        const int64_t blk = st->tables[(int64_t)b * st->width + j];
        int t0, t1, packed_end;
        block_span(st, value, b, j, &t0, &t1, &packed_end);
        for (int t = t0; t < t1; ++t)
            for (int h = 0; h < n_kv; ++h) {
                const int64_t row = (blk * bs + t % bs) * n_kv + h;
                const float *p = probs + (int64_t)h * G * n + (t - first);
                if (t < packed_end) {
                    unpack_row((const uint8_t *)value->data + row * nb, nb, value->bits, codes);
                    const float *sc = value->scale + row * n_groups, *z = value->zero + row * n_groups;
                    for (int grp = 0; grp < n_groups; ++grp) /* bytes [grp * span, +span) of every field */
                        for (int k = 0; k < per; ++k) {
                            const int at = k * nb + grp * span;
#pragma omp simd
                            for (int i = 0; i < span; ++i) row_values[at + i] = codes[at + i] * sc[grp] + z[grp];
                        }
                    for (int g = 0; g < G; ++g) axpy(acc_q + (h * G + g) * D, p[g * n], row_values, D);
                } else {
                    const float *v = value->bits == 16 ? (const float *)value->data + row * D
                                                       : ring_row(value, st, b, t, h);
                    for (int g = 0; g < G; ++g) axpy(part + (h * G + g) * D, p[g * n], v, D);
                }
            }
    }
    if (value->bits != 16)
        for (int hg = 0; hg < H; ++hg)
            for (int k = 0; k < per; ++k)
                for (int i = 0; i < nb; ++i) part[hg * D + i * per + k] += acc_q[hg * D + k * nb + i];
}

/* head dims compiled as constants (others run the same code with D a variable) */
#define D_CASES(CALL) \
    switch (st->D) { \
    case 64: CALL(64); break; \
    case 128: CALL(128); break; \
    default: CALL(st->D); \
    }

static void score_chunk(const Step *st, Chunk c, float *qs, float *qz, float *codes) {
#define SCORE(d) score_chunk_d(st, c, qs, qz, codes, d)
    D_CASES(SCORE)
#undef SCORE
}

static void mix_chunk(const Step *st, Chunk c, float *part, float *acc_q, float *row_values, float *codes) {
#define MIX(d) mix_chunk_d(st, c, part, acc_q, row_values, codes, d)
    D_CASES(MIX)
#undef MIX
}

static int side_ok(const Side *side, int D, int is_value) {
    if (side->bits == 16) return 1;
    if (side->bits != 8 && side->bits != 4 && side->bits != 2) return 0;
    const int per = 8 / side->bits;
    return D % per == 0 && (!is_value || (side->group > 0 && side->group % per == 0 && D % side->group == 0));
}

/* Returns 0, or 1 when a shape is beyond the kernel's bounds (the caller falls back), 2 when out of memory. */
int skistune_paged_decode(const float *q, float *out, int32_t B, int32_t H, int32_t n_kv, int32_t D,
                          const int64_t *tables, int32_t width, const int64_t *context_lens,
                          const int64_t *first_slots, const int64_t *fp_start, const int64_t *ring_slots,
                          int32_t R, int32_t bs, float scale, const Side *key, const Side *value, float *stats,
                          int32_t stats_len) {
    if (n_kv <= 0 || H % n_kv || D <= 0 || !side_ok(key, D, 0) || !side_ok(value, D, 1)) return 1;
    Step st = {B, H, n_kv, D, H / n_kv, width, R, bs, scale, q, tables, context_lens, first_slots, fp_start,
               ring_slots, key, value, NULL, NULL};
    int64_t *offsets = malloc(sizeof(int64_t) * (B + 1)), *chunk_of = malloc(sizeof(int64_t) * (B + 1));
    int failed = offsets == NULL || chunk_of == NULL;
    int64_t n_chunks = 0;
    for (int b = 0; !failed && b < B; ++b) {
        const int first = row_first(&st, b), L = (int)context_lens[b];
        if (L - first < 1 || L > width * bs) failed = 1;  /* nothing to attend, or past its block table */
        offsets[b + 1] = (b ? offsets[b] : 0) + (int64_t)H * (L - first);
        chunk_of[b] = n_chunks;
        n_chunks += ((L + bs - 1) / bs - first / bs + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
    }
    if (failed) {
        free(offsets), free(chunk_of);
        return offsets && chunk_of ? 1 : 2;
    }
    offsets[0] = 0, chunk_of[B] = n_chunks;
    Chunk *chunks = malloc(sizeof(Chunk) * n_chunks);
    float *scores = malloc(sizeof(float) * offsets[B]), *parts = malloc(sizeof(float) * n_chunks * H * D);
    failed = chunks == NULL || scores == NULL || parts == NULL;
    for (int b = 0, i = 0; !failed && b < B; ++b) {
        const int last = (int)((context_lens[b] + bs - 1) / bs);
        for (int j = row_first(&st, b) / bs; j < last; j += CHUNK_BLOCKS, ++i)
            chunks[i] = (Chunk){b, j, j + CHUNK_BLOCKS < last ? j + CHUNK_BLOCKS : last};
    }
    st.scores = scores, st.offsets = offsets;
#pragma omp parallel if (!failed)
    {
        /* per thread: folded queries, their zero terms, packed-value accumulators, one token's codes and
         * dequantized values */
        float *scratch = failed ? NULL : malloc(sizeof(float) * (2 * H * D + H + 2 * D));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *qs = scratch, *acc_q = scratch + H * D, *qz = scratch + 2 * H * D, *codes = qz + H;
            float *row_values = codes + D;
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_chunks; ++i) score_chunk(&st, chunks[i], qs, qz, codes);
#pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < B * n_kv; ++task) softmax_head(&st, task / n_kv, task % n_kv, stats, stats_len);
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_chunks; ++i) mix_chunk(&st, chunks[i], parts + i * H * D, acc_q, row_values, codes);
#pragma omp for
            for (int b = 0; b < B; ++b) { /* the row's chunks summed */
                float *o = out + (int64_t)b * H * D;
                memcpy(o, parts + chunk_of[b] * H * D, sizeof(float) * H * D);
                for (int64_t i = chunk_of[b] + 1; i < chunk_of[b + 1]; ++i) axpy(o, 1.0f, parts + i * H * D, H * D);
            }
        }
        free(scratch);
    }
    free(offsets), free(chunk_of), free(chunks), free(scores), free(parts);
    return failed ? 2 : 0;
}
