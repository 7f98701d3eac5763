// The int8 block products on 256-bit vectors (ymm: 16 registers, 32 bytes per instruction), included by
// quant_linear.cpp inside its namespace `ymm`, after the shared definitions (QW, BlockActs, KBytes,
// param_at, ...) it uses. AVX2 and AVX-VNNI builds run only these; AVX-512 builds run them too where the
// CPU plan picks 256-bit dots (PERFXLM_DOT_WIDTH: CPUs that split each 512-bit operation into two 256-bit
// halves, Zen 4), with vpdpbusd on ymm (AVX512-VL + VNNI). No include guard: one inclusion per build.
// ---------------------------------------------------------------------------------------------
// The same products on AVX2 (16 ymm registers, 32 bytes per instruction): each 64-input chunk is two
// 32-byte halves, and the 16 int32 lanes of the AVX-512 kernel are the two halves' 8, so the
// activations keep the layout quantize_blocks writes. uint8 x int8 -> int32 sums of 4 products run as
// vpmaddubsw + vpmaddwd (llama.cpp's AVX2 scheme), or vpdpbusd on ymm where the CPU has AVX-VNNI.
// vpmaddubsw saturates its int16 pair sums: 4-bit codes (<= 15) cannot reach it, 8-bit codes (<= 255)
// can, so without AVX-VNNI they enter as code - 128 (signed), multiplied as |c| x sign(c) x, and the
// 128 * scale taken off is given back with the mins. The sign goes onto the activations, not the codes
// (llama.cpp's other order, |x| stored once per call and sign(c, x) per code, would save one vpsignb per
// 32 codes): a code u = 0 is c = -128, whose negation int8 cannot hold, and the code formats here
// (asymmetric int8, a Q8_0 block holding -128) may have it.
// ---------------------------------------------------------------------------------------------
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// AVX512-VNNI with AVX512-VL: vpdpbusd on ymm (its EVEX form), the 256-bit kernels of AVX-512 builds
constexpr bool kShift8 = false;
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
constexpr bool kShift8 = false;
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
// Each dot product starts from z, its lanes' int32 starts (BlockActs::starts: zero, or minus the centre's
// share, which vpdpbusd accumulates onto for free). Without vpdpbusd the starts are always zero
// (kCanFold) and not read.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
inline __m256i dot_pairs(__m256i z, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  return dot_acc(dot_acc(z, u0, s0), u1, s1);
}
inline __m256i dot_u8(__m256i z, __m256i u, __m256i s) { return dot_acc(z, u, s); }
inline __m256i dot_u6(__m256i z, __m256i u, __m256i s) { return dot_acc(z, u, s); }
#else
constexpr bool kShift8 = true;
// Two halves whose codes are 4-bit: the int16 pair sums of both fit (2 * 2 * 15 * 127), so they are
// added before widening.
inline __m256i dot_pairs(__m256i, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
// One half whose codes are at most 6-bit (groups of 16 take a scale per half): the int16 pair sums fit
// (2 * 63 * 127), no sign trick.
inline __m256i dot_u6(__m256i, __m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
inline __m256i dot_u8(__m256i, __m256i u, __m256i s) {
  const __m256i c = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));  // code - 128
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(s, c)),
                           _mm256_set1_epi16(1));
}
#endif

// Chunk c's starts of activation row m (BlockActs::starts), and its 8 lanes from `at` (0: the lo half's,
// 8: the hi half's, 16: both halves' added); zero without vpdpbusd.
inline const int32_t* chunk_starts(const BlockActs& a, int64_t m, int64_t chunks, int64_t c) {
  return a.starts + (m * chunks + c) * 24;
}
inline __m256i start8(const int32_t* st, int at) {
  if constexpr (kCanFold)
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + at));
  else
    return _mm256_setzero_si256();
}

// 8 consecutive scales or mins of a row as float32.
template <bool HALF>
inline __m256 load_params8(const void* p, int64_t i) {
  if constexpr (HALF)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  else
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

// Two or four consecutive scales as the low lanes of a register.
template <bool HALF, int COUNT>
inline __m128 load_params_lo(const void* p, int64_t i) {
  if constexpr (HALF) {
    const uint16_t* src = static_cast<const uint16_t*>(p) + i;
    if constexpr (COUNT == 2) {
      int32_t v;
      std::memcpy(&v, src, sizeof(v));
      return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
    } else {
      return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    }
  } else {
    const float* src = static_cast<const float*>(p) + i;
    if constexpr (COUNT == 2)
      return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(src)));
    else
      return _mm_loadu_ps(src);
  }
}

// The 8 lanes' sum as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)): the order hsum4x8 adds in, so a
// row's result does not depend on which kernel (one row, or four at once) computed it.
inline float hsum8(__m256 s) {
  const __m256 h = _mm256_hadd_ps(s, s);
  const __m256 h2 = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

// Four rows' sums at once, each in hsum8's order: [sum a, sum b, sum c, sum d].
inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Sum over the row's groups of min (plus 128 * scale for shifted 8-bit codes) times the activations'
// group sums: 8 groups per step, the last few one by one (gsum is zero-padded, the weight's rows not).
// Centred 8-bit codes shifted by 128 are exactly the signed values: nothing to add.
// Nothing where the centre was folded into the dot products' starts (folded: BlockActs::folded).
template <bool BITS4, bool HALF>
inline __m256 add_mins(__m256 acc, const QW& w, int64_t row_base, const float* gsum, bool folded) {
  constexpr bool shifted = !BITS4 && kShift8;
  if (folded || (shifted && w.centred && !w.levels)) return acc;
  const __m256 factor = _mm256_set1_ps(w.block_min_factor);
  int64_t g = 0;
  for (; g + 8 <= w.groups; g += 8) {
    __m256 mv = _mm256_mul_ps(load_params8<HALF>(w.mins, row_base + g), factor);
    if constexpr (shifted) mv = _mm256_fmadd_ps(load_params8<HALF>(w.scales, row_base + g), _mm256_set1_ps(128.f), mv);
    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(gsum + g), acc);
  }
  if (g < w.groups && w.groups >= 8) {
    // the last few groups as one more step over the row's last 8, the lanes already added multiplied by
    // a zeroed activation sum (a scalar loop here was a tenth of a batch-1 row of 576 inputs)
    const int64_t last = w.groups - 8;
    const __m256i done = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(g - last)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 mv = _mm256_mul_ps(load_params8<HALF>(w.mins, row_base + last), factor);
    if constexpr (shifted) mv = _mm256_fmadd_ps(load_params8<HALF>(w.scales, row_base + last), _mm256_set1_ps(128.f), mv);
    return _mm256_fmadd_ps(mv, _mm256_andnot_ps(_mm256_castsi256_ps(done), _mm256_loadu_ps(gsum + last)), acc);
  }
  float tail = 0.f;
  for (; g < w.groups; ++g) {
    float m = param_at<HALF>(w.mins, row_base + g) * w.block_min_factor;
    if constexpr (shifted) m += 128.f * param_at<HALF>(w.scales, row_base + g);
    tail += m * gsum[g];
  }
  return _mm256_add_ps(acc, _mm256_setr_ps(tail, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f));
}

// Rows this far ahead are requested whole (codes, scales, mins) when a row starts: a row of a small
// model is a few cache lines, too short for the hardware prefetchers to ramp up on.
constexpr int64_t kPrefetchRows = 16;

// How the four-row batch-1 tiles prefetch. AVX2 builds (Zen 3's measurements): whole rows kPrefetchRows
// ahead at each tile's start. AVX-512 builds (these tiles chosen on Zen 4): chunk c's line of the next
// tile's rows with chunk c, as the zmm tiles do; the whole-row requests left these tiles 15-30 % behind
// the zmm ones on weights streamed from memory (default model's decode-step weights, one thread's CPU
// time per call, alternating, loaded machine), the per-chunk ones 3-9 % ahead on Q8_0 and Q5_0.
#ifdef __AVX512F__
constexpr bool kChunkPrefetch = true;
#else
constexpr bool kChunkPrefetch = false;
#endif

inline void prefetch_row(const QW& w, int64_t n) {
  if (n >= w.N) return;
  const char* codes = reinterpret_cast<const char*>(w.codes + n * w.row_bytes);
  for (int64_t o = 0; o < w.row_bytes; o += 64) _mm_prefetch(codes + o, _MM_HINT_T0);
  const int64_t pbytes = w.groups * (w.half ? 2 : 4);
  const char* sc = static_cast<const char*>(w.scales) + n * pbytes;
  const char* mn = static_cast<const char*>(w.mins) + n * pbytes;
  for (int64_t o = 0; o < pbytes; o += 64) {
    _mm_prefetch(sc + o, _MM_HINT_T0);
    if (!w.centred) _mm_prefetch(mn + o, _MM_HINT_T0);
  }
}

// Every cache line of [p, p + bytes), four requests per loop step.
inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  int64_t o = 0;
  for (; o + 256 <= bytes; o += 256) {
    _mm_prefetch(c + o, _MM_HINT_T0);
    _mm_prefetch(c + o + 64, _MM_HINT_T0);
    _mm_prefetch(c + o + 128, _MM_HINT_T0);
    _mm_prefetch(c + o + 192, _MM_HINT_T0);
  }
  for (; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// prefetch_row for `count` consecutive rows from n (float scales or two-level bytes): their codes, scales
// and mins are each one contiguous range, requested as such. At batch 1 a four-row tile of a 576-wide
// weight is ~250 instructions a row, and the per-row loops (a request, an add, a compare and a branch per
// line) were a tenth of them.
inline void prefetch_rows(const QW& w, int64_t n, int64_t count) {
  count = std::min(count, w.N - n);
  if (count <= 0) return;
  prefetch_range(w.codes + n * w.row_bytes, count * w.row_bytes);
  if (w.kscales) {
    prefetch_range(w.kscales + n * w.kbytes, count * w.kbytes);
    if (w.kmins) prefetch_range(w.kmins + n * w.kbytes, count * w.kbytes);
    return;
  }
  const int64_t pbytes = w.groups * (w.half ? 2 : 4);
  prefetch_range(static_cast<const char*>(w.scales) + n * pbytes, count * pbytes);
  if (!w.centred) prefetch_range(static_cast<const char*>(w.mins) + n * pbytes, count * pbytes);
}

// One chunk of 4-bit (5-bit: PLANES 1, 6-bit: 2) codes as two halves of 32 bytes: lo nibbles [A 0-15,
// B 0-15], hi nibbles [A 16-31, B 16-31], each plus its plane bits (the plane's two words of the chunk,
// 8 bytes at K / 2 + 8 c, spread over the lanes once, then a shift, an and and an or per half:
// code_planes.h), or looked up in an integer table. The planes are a template argument: a branch on
// bits6 here sat in every chunk of every 5-bit row.
template <int PLANES>
inline void chunk_halves(const uint8_t* row, int64_t c, const QW& w, __m256i lut, __m256i& lo, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
  lo = _mm256_and_si256(b, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
  if constexpr (PLANES > 0) {
    const __m256i f = perfxlm_planes::chunk_words(row + w.K / 2 + c * 8);
    lo = _mm256_or_si256(lo, perfxlm_planes::lo_fifths(f));
    hi = _mm256_or_si256(hi, perfxlm_planes::hi_fifths(f));
    if constexpr (PLANES == 2) {  // the sixth plane, K / 8 bytes after the fifth, in its order: 32 where set
      const __m256i x = perfxlm_planes::chunk_words(row + w.K / 2 + w.K / 8 + c * 8);
      lo = _mm256_or_si256(lo, perfxlm_planes::lo_sixths(x));
      hi = _mm256_or_si256(hi, perfxlm_planes::hi_sixths(x));
    }
  } else if (w.int_lut) {
    lo = _mm256_shuffle_epi8(lut, lo);
    hi = _mm256_shuffle_epi8(lut, hi);
  }
}

// acc + one 64-input chunk of 8-bit codes (lo, hi: its two blocks) against one activation row, each
// block scaled by weight scale x activation scale. The two blocks' int32 lanes are summed pairwise into
// one register ([A A B B | A A B B]: vphaddd) so one conversion and one FMA serve the chunk, and the
// four scale products are one vector multiply of the weight row's scales (wscale8, spread to those lanes
// once per chunk and shared by every activation row of a tile) by the activation row's, stored spread
// (BlockActs::pair8): the float work per chunk was as much as the integer dot products (measured 1.2-1.3x
// per GEMV on this tier), and spreading the products per activation row cost a shuffle each.
inline __m256 chunk_dot8(__m256i lo, __m256i hi, const int8_t* xc, const int32_t* st, __m256 wscale8, const float* xscale8,
                         __m256 acc) {
  const __m256i d0 = dot_u8(start8(st, 0), lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)));
  const __m256i d1 = dot_u8(start8(st, 8), hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(d0, d1)), _mm256_mul_ps(wscale8, _mm256_loadu_ps(xscale8)),
                         acc);
}

// One 64-input chunk of 6-bit codes at groups of 16 (halves lo, hi as chunk_halves gives them) against one
// activation row (xc; xs its 16 lane scales, [A x4, B x4] per half): each half's int32 sums times its weight
// scales (ws_lo, ws_hi: block_tile's spread) x activation scales into its own accumulator, acc[0] and acc[1].
inline void six_bit_chunk(__m256i lo, __m256i hi, const int8_t* xc, const int32_t* st, const float* xs, __m256 ws_lo,
                          __m256 ws_hi, __m256 (&acc)[2]) {
  const __m256i d0 = dot_u6(start8(st, 0), lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)));
  const __m256i d1 = dot_u6(start8(st, 8), hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32)));
  acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(ws_lo, _mm256_loadu_ps(xs)), acc[0]);
  acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(ws_hi, _mm256_loadu_ps(xs + 8)), acc[1]);
}

// One chunk of 8-bit codes at groups of 16 against activation row i: each 32-byte half dotted onto its
// int32 start, scaled by its two groups' scales (ws_lo, ws_hi) times its block's activation scale
// (xs: lanes 0-7 block A's, 8-15 B's). The plain and the two-level scales' tiles share it.
inline void eight_bit_chunk(__m256i lo, __m256i hi, const int8_t* xc, const int32_t* st, const float* xs,
                            __m256 ws_lo, __m256 ws_hi, __m256 (&acc)[2]) {
  const __m256i d0 = dot_u8(start8(st, 0), lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)));
  const __m256i d1 = dot_u8(start8(st, 8), hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32)));
  acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(ws_lo, _mm256_broadcast_ss(xs)), acc[0]);
  acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(ws_hi, _mm256_broadcast_ss(xs + 8)), acc[1]);
}

// A chunk's two block scales of one weight row spread as chunk_dot8's lanes: [A A B B A A B B].
template <bool HALF, int SPC>
inline __m256 block_scales8(const QW& w, int64_t g0) {
  if constexpr (SPC == 1)
    return _mm256_set1_ps(param_at<HALF>(w.scales, g0));
  else
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(load_params_lo<HALF, 2>(w.scales, g0)),
                                    _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1));
}

// The first of chunk c's weight groups, counted from the row's first: a multiply (or for groups of 64 or
// more a division that is 1 at the usual 64) instead of a 64-bit idiv per chunk, which sat in every
// chunk of every row (10-40 cycles' latency, more than the chunk's dot products at one row).
template <int SPC>
inline int64_t chunk_group(const QW& w, int64_t c) {
  if constexpr (SPC == 1) {
    const int64_t per = w.group / 64;  // chunks per group
    return per == 1 ? c : c / per;
  } else {
    return c * SPC;
  }
}

// NT weight rows, one after the other (a row of a small model is a few cache lines, and consecutive
// rows are one stream), each against MT activation rows: MT accumulators, everything else transient.
template <bool BITS4, bool HALF, int SPC, int MT, int NT, int PLANES>
inline void block_tile(const BlockActs& a, int64_t m0, const QW& w, int64_t n0, float* y, const float* bias) {
  const int64_t K = w.K, N = w.N, chunks = K / 64, groups = w.groups;
  const int8_t* xq = a.q + m0 * K;
  const float* lanes = a.lanes + m0 * chunks * 16;
  // lane l of a half covers code bytes 4l..4l+3: 4-bit halves hold [block A x4 lanes, block B x4 lanes]
  // of the chunk, 8-bit halves one block each (group 16: two groups of 4 lanes)
  const __m256i lo_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hi_idx = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(w.ulut)));
  for (int j = 0; j < NT; ++j) {
    const int64_t n = n0 + j, row_base = n * groups;
    const uint8_t* row = w.codes + n * w.row_bytes;
    prefetch_row(w, n + kPrefetchRows);
    // 4-bit, and 8-bit with a scale per block: one accumulator per activation row, updated in the order
    // block_tile_m1x4(_q8) updates it (the same sums whether a row is decoded alone or with others);
    // 8-bit at group 16: one per half of the chunk, two FMA chains
    __m256 acc[MT][2];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t g0 = row_base + chunk_group<SPC>(w, c);
      if constexpr (BITS4 && SPC == 4) {
        // groups of 16 (6-bit codes): the lo half [A 0-15, B 0-15] takes the chunk's groups 0 and 2, the
        // hi half [A 16-31, B 16-31] groups 1 and 3, so the halves are dotted and scaled apart
        __m256i lo, hi;
        chunk_halves<PLANES>(row, c, w, lut, lo, hi);
        const __m256 s4 = _mm256_castps128_ps256(load_params_lo<HALF, 4>(w.scales, g0));
        const __m256 ws_lo = _mm256_permutevar8x32_ps(s4, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
        const __m256 ws_hi = _mm256_permutevar8x32_ps(s4, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
        #pragma GCC unroll 4
        for (int i = 0; i < MT; ++i)
          six_bit_chunk(lo, hi, xq + i * K + c * 64, chunk_starts(a, m0 + i, chunks, c), lanes + (i * chunks + c) * 16, ws_lo,
                        ws_hi, acc[i]);
      } else if constexpr (BITS4) {
        __m256i lo, hi;
        chunk_halves<PLANES>(row, c, w, lut, lo, hi);
        // both halves carry [A x4, B x4] weight and activation scales, so their int32 sums add up
        __m256 ws;
        if constexpr (SPC == 1)
          ws = _mm256_set1_ps(param_at<HALF>(w.scales, g0));
        else
          ws = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(load_params_lo<HALF, 2>(w.scales, g0)), lo_idx);
        #pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          const int8_t* xc = xq + i * K + c * 64;
          const __m256i d = dot_pairs(start8(chunk_starts(a, m0 + i, chunks, c), 16), lo,
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)), hi,
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32)));
          const __m256 xs = _mm256_loadu_ps(lanes + (i * chunks + c) * 16);
          acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws, xs), acc[i][0]);
        }
      } else {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 64));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 64 + 32));
        if constexpr (SPC == 4) {
          const __m256 s4 = _mm256_castps128_ps256(load_params_lo<HALF, 4>(w.scales, g0));
          const __m256 ws_lo = _mm256_permutevar8x32_ps(s4, lo_idx), ws_hi = _mm256_permutevar8x32_ps(s4, hi_idx);
          #pragma GCC unroll 8
          for (int i = 0; i < MT; ++i)
            eight_bit_chunk(lo, hi, xq + i * K + c * 64, chunk_starts(a, m0 + i, chunks, c), lanes + (i * chunks + c) * 16,
                            ws_lo, ws_hi, acc[i]);
        } else {  // one scale per half (block): see chunk_dot8
          const __m256 ws8 = block_scales8<HALF, SPC>(w, g0);
          #pragma GCC unroll 8
          for (int i = 0; i < MT; ++i)
            acc[i][0] = chunk_dot8(lo, hi, xq + i * K + c * 64, chunk_starts(a, m0 + i, chunks, c), ws8,
                                   a.pair8 + ((m0 + i) * chunks + c) * 8, acc[i][0]);
        }
      }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      // 4-bit codes and 8-bit ones with a scale per block keep one accumulator (the one
      // block_tile_m1x4 keeps): adding the unused one would change nothing but the sign of a zero
      const __m256 sum = SPC <= 2 ? acc[i][0] : _mm256_add_ps(acc[i][0], acc[i][1]);
      const __m256 total = add_mins<BITS4, HALF>(sum, w, row_base, a.gsum + (m0 + i) * a.gstride, a.folded);
      y[(m0 + i) * N + n] = hsum8(total) + (bias ? bias[n] : 0.f);
    }
  }
}
// The four weight rows a batch-1 tile reads from n0: where each one's codes and groups start, with the
// rows kPrefetchRows further on requested (the setup both four-row kernels below share).
struct FourRows {
  const uint8_t* row[4];
  int64_t base[4];
};

inline FourRows four_rows(const QW& w, int64_t n0) {
  FourRows r;
  #pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    r.row[j] = w.codes + (n0 + j) * w.row_bytes;
    r.base[j] = (n0 + j) * w.groups;
  }
  if constexpr (!kChunkPrefetch) prefetch_rows(w, n0 + kPrefetchRows, 4);
  return r;
}

// Chunk c's line of each of the four rows `ahead_bytes` on (a 64-byte line: every chunk of 8-bit codes,
// every other one of 4-bit codes), where kChunkPrefetch.
template <int BYTES>
inline void prefetch_chunk(const uint8_t* const* row, int64_t c, int64_t ahead_bytes) {
  if (kChunkPrefetch && (BYTES == 64 || (c & 1) == 0)) {
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(row[j] + ahead_bytes + c * BYTES), _MM_HINT_T0);
  }
}

// The four rows' results: each accumulator plus its mins, reduced together (block_tile's order for each)
// into one 4-float store at y[n0..n0 + 3] of activation row m.
template <bool BITS4, bool HALF>
inline void store_four(__m256 (&acc)[4], const FourRows& r, const BlockActs& a, int64_t m, const QW& w, int64_t n0,
                       float* y, const float* bias) {
  const float* gsum = a.gsum + m * a.gstride;
  #pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) acc[j] = add_mins<BITS4, HALF>(acc[j], w, r.base[j], gsum, a.folded);
  __m128 sum = hsum4x8(acc[0], acc[1], acc[2], acc[3]);
  if (bias) sum = _mm_add_ps(sum, _mm_loadu_ps(bias + n0));
  _mm_storeu_ps(y + m * w.N + n0, sum);
}

// Batch-1 decode, four weight rows at once against the one activation row: the activation loads are
// shared by the four rows, the four accumulators are four independent FMA chains, and the four sums are
// reduced together into one 4-float store. At decode a row of a small model is 9-24 chunks, so the
// per-row work of block_tile (its loads of the activations, reduction, store) was a quarter of the
// time (measured 1.15-1.25x per GEMV on Zen 3). Each row's operations are block_tile's, in its order:
// the results are the same bits. 4-bit (and 5-bit) codes here; 8-bit ones in block_tile_m1x4_q8 below.
template <bool BITS4, bool HALF, int SPC, int PLANES>
inline void block_tile_m1x4(const BlockActs& a, int64_t m, const QW& w, int64_t n0, float* y, const float* bias) {
  static_assert(BITS4, "four rows at once: 4-bit codes only");
  const int64_t K = w.K, chunks = K / 64;
  const int8_t* xq = a.q + m * K;
  const float* lanes = a.lanes + m * chunks * 16;
  const __m256i lo_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(w.ulut)));
  const FourRows r = four_rows(w, n0);
  const int64_t ahead = 4 * w.row_bytes;  // the next tile
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  // chunk c of the four rows, row j's weight scales spread over the lanes as scales(j) returns them
  const auto chunk = [&](int64_t c, const auto& scales) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 64));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 64 + 32));
    const __m256 xv = _mm256_loadu_ps(lanes + c * 16);
    const __m256i z = start8(chunk_starts(a, m, chunks, c), 16);
    prefetch_chunk<32>(r.row, c, ahead);
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i lo, hi;
      chunk_halves<PLANES>(r.row[j], c, w, lut, lo, hi);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_pairs(z, lo, x0, hi, x1)), _mm256_mul_ps(scales(j), xv), acc[j]);
    }
  };
  int64_t c = 0;
  if constexpr (SPC == 2 && HALF) {
    // Four chunks' 8 float16 scales per row in one load and conversion, each chunk's pair spread by one
    // permute (a load, a conversion and a permute per chunk and row before): the same floats, the same
    // bits. Float32 scales (GGUF K-quants multiplied out) keep their load and permute per chunk: no
    // conversion to save, and the four-chunk form measured slower there.
    for (; c + 4 <= chunks; c += 4) {
      __m256 s8[4];
      #pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) s8[j] = load_params8<HALF>(w.scales, r.base[j] + 2 * c);
      #pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m256i idx = _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1);
        chunk(c + q, [&](int j) { return _mm256_permutevar8x32_ps(s8[j], idx); });
      }
    }
  }
  for (; c < chunks; ++c) {
    const int64_t goff = chunk_group<SPC>(w, c);
    chunk(c, [&](int j) {
      if constexpr (SPC == 1)
        return _mm256_set1_ps(param_at<HALF>(w.scales, r.base[j] + goff));
      else
        return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(load_params_lo<HALF, 2>(w.scales, r.base[j] + goff)),
                                        lo_idx);
    });
  }
  store_four<BITS4, HALF>(acc, r, a, m, w, n0, y, bias);
}

// block_tile_m1x4 for 8-bit codes with a scale per block (Q8_0, symmetric int8 at group 32 or more):
// the activation loads shared by four rows, four FMA chains, one reduction for the four. Each row's
// operations are block_tile's (chunk_dot8, in its order): the same bits.
template <bool HALF, int SPC>
inline void block_tile_m1x4_q8(const BlockActs& a, int64_t m, const QW& w, int64_t n0, float* y, const float* bias) {
  static_assert(SPC <= 2, "four rows at once: one scale per 8-bit block");
  const int64_t K = w.K, chunks = K / 64;
  const int8_t* xq = a.q + m * K;
  const float* pair8 = a.pair8 + m * chunks * 8;
  const FourRows r = four_rows(w, n0);
  const int64_t ahead = 4 * w.row_bytes;  // the next tile
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t goff = chunk_group<SPC>(w, c);
    const int32_t* st = chunk_starts(a, m, chunks, c);
    prefetch_chunk<64>(r.row, c, ahead);
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.row[j] + c * 64));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.row[j] + c * 64 + 32));
      acc[j] = chunk_dot8(lo, hi, xq + c * 64, st, block_scales8<HALF, SPC>(w, r.base[j] + goff), pair8 + c * 8, acc[j]);
    }
  }
  store_four<false, HALF>(acc, r, a, m, w, n0, y, bias);
}
