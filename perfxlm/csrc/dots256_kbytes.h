// The int8 block products of two-level rows (GGUF K-quants, int4's super-block form) on 256-bit
// vectors: dots256.h's tiles reading the scale bytes (quant_linear.cpp's comment before kq_takes says
// how). Included right after dots256.h, inside the same namespace. No include guard.
// 8 sub-values of a two-level row from group g, widened to float32 (exact).
template <bool SIGNED>
inline __m256 kbytes8(const uint8_t* sub, int64_t g) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + g));
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// The factors of groups g..g + 7 times sign, lane l holding factor (g + l) / per; g a multiple of 8 (per
// >= 8: one factor, per being 8 or 16) or of per (per 1, 2, 4: 8 / per factors spread).
inline __m256 kfactors8(const uint8_t* fac, int64_t g, int64_t per, float sign) {
  const __m256 signs = _mm256_set1_ps(sign);
  if (per >= 8)  // broadcast as float16, then converted: two instructions where a scalar conversion took four
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(k_half(fac, g / per)))), signs);
  const uint8_t* f = fac + 2 * (g / per);
  __m128i h;
  __m256i idx;
  if (per == 4) {
    int32_t v;
    std::memcpy(&v, f, sizeof(v));
    h = _mm_cvtsi32_si128(v);
    idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  } else if (per == 2) {
    h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(f));
    idx = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  } else {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f));
    idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  }
  return _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_cvtph_ps(h), idx), signs);
}

// Groups g..g + 7 of a two-level row: sub x (factor x sign), expand_row's values.
template <bool SIGNED>
inline __m256 kvalues8(KBytes r, int64_t g, int64_t per, float sign) {
  return _mm256_mul_ps(kbytes8<SIGNED>(r.sub, g), kfactors8(r.fac, g, per, sign));
}

// prefetch_row for two-level rows: the codes, then the scale and min bytes.
inline void kprefetch_row(const QW& w, int64_t n) {
  if (n >= w.N) return;
  const char* codes = reinterpret_cast<const char*>(w.codes + n * w.row_bytes);
  for (int64_t o = 0; o < w.row_bytes; o += 64) _mm_prefetch(codes + o, _MM_HINT_T0);
  const char* sc = reinterpret_cast<const char*>(w.kscales + n * w.kbytes);
  const char* mn = w.kmins ? reinterpret_cast<const char*>(w.kmins + n * w.kbytes) : nullptr;
  for (int64_t o = 0; o < w.kbytes; o += 64) {
    _mm_prefetch(sc + o, _MM_HINT_T0);
    if (mn) _mm_prefetch(mn + o, _MM_HINT_T0);
  }
}

// add_mins for two-level row n: the same steps (8 groups, the last few as one more masked step, or one
// by one under 8 groups), each min formed from its bytes. A stored min is -(byte x factor): its bytes
// times the factor, subtracted (fnmadd: the same single rounding as adding the negated product). Centred
// codes (Q6_K's 8-bit ones; kq_takes) add scale x min_factor, the factor times it exactly (a power of
// two), or nothing where the codes were shifted by 128 (AVX2 without AVX-VNNI: they are the signed values).
//
// PER: the groups per factor where the layout fixes it (8: groups of 32; 16: Q6_K's groups of 16), 0 where
// it does not (int4's groups of 64-256). With PER >= 8 every 8-group step lies in one super-block and the
// row's groups are whole steps: one factor per step at a fixed place, no tail. At batch 1 the general
// loop (the factor's place found by a division per step, a branch on the layout per step, the stored /
// centred choice per step) was about a fifth of a Q4_K row's instructions; this one adds the same values
// in the same order.
template <bool BITS4, bool SIGNED, int PER = 0>
inline __m256 kadd_mins(__m256 acc, const QW& w, int64_t n, const float* gsum, bool folded) {
  if constexpr (!BITS4 && kShift8) return acc;
  if (folded) return acc;  // the centre went into the dot products' starts
  if constexpr (PER >= 8) {
    if (w.kmins) {
      const KBytes src = kmin_bytes(w, n);
      for (int64_t g = 0; g < w.groups; g += 8)
        acc = _mm256_fnmadd_ps(kvalues8<false>(src, g, PER, 1.f), _mm256_loadu_ps(gsum + g), acc);
    } else {
      const KBytes src = kscale_bytes(w, n);
      const float factor = w.block_min_factor;
      for (int64_t g = 0; g < w.groups; g += 8)
        acc = _mm256_fmadd_ps(kvalues8<SIGNED>(src, g, PER, factor), _mm256_loadu_ps(gsum + g), acc);
    }
    return acc;
  }
  const bool stored = w.kmins != nullptr;
  const KBytes src = stored ? kmin_bytes(w, n) : kscale_bytes(w, n);
  const int64_t per = w.kper;
  const float factor = stored ? 1.f : w.block_min_factor;
  const auto step = [&](int64_t g, __m256 sums, __m256 a) {
    if (stored) return _mm256_fnmadd_ps(kvalues8<false>(src, g, per, 1.f), sums, a);
    return _mm256_fmadd_ps(kvalues8<SIGNED>(src, g, per, factor), sums, a);
  };
  int64_t g = 0;
  for (; g + 8 <= w.groups; g += 8) acc = step(g, _mm256_loadu_ps(gsum + g), acc);
  if (g < w.groups && w.groups >= 8) {  // per < 8 here, and groups - 8 a multiple of it
    const int64_t last = w.groups - 8;
    const __m256i done = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(g - last)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return step(last, _mm256_andnot_ps(_mm256_castsi256_ps(done), _mm256_loadu_ps(gsum + last)), acc);
  }
  float tail = 0.f;
  for (; g < w.groups; ++g) {
    const float m = (stored ? -k_value(src, g, per, false) : k_value(src, g, per, SIGNED)) * w.block_min_factor;
    tail += m * gsum[g];
  }
  return _mm256_add_ps(acc, _mm256_setr_ps(tail, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f));
}

// block_tile_m1x4 on two-level 4- or 5-bit rows: four rows against the one activation row, each row's
// 8 scales of a super-block formed once for its four chunks (groups of 32), or one scale per chunk
// (groups of 64 or more).
template <int PLANES, int SPC>
inline void kq_tile_m1x4(const BlockActs& a, const QW& w, int64_t n0, float* y, const float* bias) {
  const int64_t K = w.K, chunks = K / 64;
  const __m256i lut = _mm256_setzero_si256();  // two-level codes take no table
  const uint8_t* row[4];
  KBytes sc[4];
  #pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    row[j] = w.codes + (n0 + j) * w.row_bytes;
    sc[j] = kscale_bytes(w, n0 + j);
  }
  const int64_t ahead = 4 * w.row_bytes;  // the next tile (kChunkPrefetch)
  if constexpr (!kChunkPrefetch) prefetch_rows(w, n0 + kPrefetchRows, 4);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const auto chunk = [&](int64_t c, const auto& scales) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + c * 64));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + c * 64 + 32));
    const __m256 xv = _mm256_loadu_ps(a.lanes + c * 16);
    const __m256i z = start8(chunk_starts(a, 0, chunks, c), 16);
    prefetch_chunk<32>(row, c, ahead);
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i lo, hi;
      chunk_halves<PLANES>(row[j], c, w, lut, lo, hi);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_pairs(z, lo, x0, hi, x1)), _mm256_mul_ps(scales(j), xv), acc[j]);
    }
  };
  if constexpr (SPC == 2) {
    for (int64_t s = 0; s < chunks / 4; ++s) {
      __m256 s8[4];
      #pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) s8[j] = kvalues8<false>(sc[j], 8 * s, 8, 1.f);
      #pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m256i idx = _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1);
        chunk(4 * s + q, [&](int j) { return _mm256_permutevar8x32_ps(s8[j], idx); });
      }
    }
  } else {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t g = chunk_group<1>(w, c);
      chunk(c, [&](int j) { return _mm256_set1_ps(k_value(sc[j], g, w.kper, false)); });
    }
  }
  #pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) acc[j] = kadd_mins<true, false, SPC == 2 ? 8 : 0>(acc[j], w, n0 + j, a.gsum, a.folded);
  __m128 sum = hsum4x8(acc[0], acc[1], acc[2], acc[3]);
  if (bias) sum = _mm_add_ps(sum, _mm_loadu_ps(bias + n0));
  _mm_storeu_ps(y + n0, sum);
}

// block_tile's one weight row n against MT activation rows from m0, on two-level rows: 4- or 5-bit codes
// (their super-block's 8 scales formed once for four chunks, or one per chunk), or 8-bit codes at groups
// of 16 (a super-block's 16 scales formed once, as two registers, for its four chunks).
template <bool BITS4, bool SIGNED, int SPC, int MT, int PLANES>
inline void kq_row(const BlockActs& a, int64_t m0, const QW& w, int64_t n, float* y, const float* bias) {
  const int64_t K = w.K, N = w.N, chunks = K / 64;
  const int8_t* xq = a.q + m0 * K;
  const float* lanes = a.lanes + m0 * chunks * 16;
  const uint8_t* row = w.codes + n * w.row_bytes;
  const KBytes sc = kscale_bytes(w, n);
  kprefetch_row(w, n + kPrefetchRows);
  __m256 acc[MT][2];
  #pragma GCC unroll 4
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  if constexpr (BITS4) {
    const __m256i lut = _mm256_setzero_si256();
    const auto chunk = [&](int64_t c, __m256 ws) {
      __m256i lo, hi;
      chunk_halves<PLANES>(row, c, w, lut, lo, hi);
      #pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        const int8_t* xc = xq + i * K + c * 64;
        const __m256i d = dot_pairs(start8(chunk_starts(a, m0 + i, chunks, c), 16), lo,
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)), hi,
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32)));
        const __m256 xs = _mm256_loadu_ps(lanes + (i * chunks + c) * 16);
        acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws, xs), acc[i][0]);
      }
    };
    if constexpr (SPC == 4) {  // 6-bit codes at groups of 16: block_tile's halves apart, a super-block's
      // 16 scales formed once, as two registers, for its four chunks (chunk q's 4 groups: lanes b..b + 3)
      for (int64_t s = 0; s < chunks / 4; ++s) {
        const __m256 s16[2] = {kvalues8<SIGNED>(sc, 16 * s, 16, 1.f), kvalues8<SIGNED>(sc, 16 * s + 8, 16, 1.f)};
        #pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const int64_t c = 4 * s + q;
          const int b = 4 * (q % 2);
          const __m256 ws_lo = _mm256_permutevar8x32_ps(s16[q / 2], _mm256_setr_epi32(b, b, b, b, b + 2, b + 2, b + 2, b + 2));
          const __m256 ws_hi =
              _mm256_permutevar8x32_ps(s16[q / 2], _mm256_setr_epi32(b + 1, b + 1, b + 1, b + 1, b + 3, b + 3, b + 3, b + 3));
          __m256i lo, hi;
          chunk_halves<PLANES>(row, c, w, lut, lo, hi);
          #pragma GCC unroll 4
          for (int i = 0; i < MT; ++i)
            six_bit_chunk(lo, hi, xq + i * K + c * 64, chunk_starts(a, m0 + i, chunks, c), lanes + (i * chunks + c) * 16, ws_lo,
                          ws_hi, acc[i]);
        }
      }
    } else if constexpr (SPC == 2) {
      for (int64_t s = 0; s < chunks / 4; ++s) {
        const __m256 s8 = kvalues8<false>(sc, 8 * s, 8, 1.f);
        #pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
          chunk(4 * s + q, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1,
                                                                           2 * q + 1, 2 * q + 1, 2 * q + 1)));
      }
    } else {
      for (int64_t c = 0; c < chunks; ++c) chunk(c, _mm256_set1_ps(k_value(sc, chunk_group<1>(w, c), w.kper, false)));
    }
  } else {
    static_assert(BITS4 || SPC == 4, "two-level 8-bit codes: groups of 16");
    for (int64_t s = 0; s < chunks / 4; ++s) {
      const __m256 s16[2] = {kvalues8<SIGNED>(sc, 16 * s, 16, 1.f), kvalues8<SIGNED>(sc, 16 * s + 8, 16, 1.f)};
      #pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const int64_t c = 4 * s + q;
        const int b = 4 * (q % 2);  // chunk c's 4 groups: lanes b..b + 3 of s16[q / 2]
        const __m256 ws_lo = _mm256_permutevar8x32_ps(s16[q / 2], _mm256_setr_epi32(b, b, b, b, b + 1, b + 1, b + 1, b + 1));
        const __m256 ws_hi =
            _mm256_permutevar8x32_ps(s16[q / 2], _mm256_setr_epi32(b + 2, b + 2, b + 2, b + 2, b + 3, b + 3, b + 3, b + 3));
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 64));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 64 + 32));
        #pragma GCC unroll 4
        for (int i = 0; i < MT; ++i)
          eight_bit_chunk(lo, hi, xq + i * K + c * 64, chunk_starts(a, m0 + i, chunks, c), lanes + (i * chunks + c) * 16,
                          ws_lo, ws_hi, acc[i]);
      }
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < MT; ++i) {
    const __m256 sum = BITS4 && SPC <= 2 ? acc[i][0] : _mm256_add_ps(acc[i][0], acc[i][1]);
    const __m256 total =
        kadd_mins<BITS4, SIGNED, SPC == 2 ? 8 : (SPC == 4 ? 16 : 0)>(sum, w, n, a.gsum + (m0 + i) * a.gstride, a.folded);
    y[(m0 + i) * N + n] = hsum8(total) + (bias ? bias[n] : 0.f);
  }
}

// Rows n0..n0 + NT - 1 against the M activation rows, MT at a time, in block_rows' order.
template <bool BITS4, bool SIGNED, int SPC, int NT, int PLANES>
inline void kq_rows(const BlockActs& a, int64_t M, const QW& w, int64_t n0, float* y, const float* bias) {
  if constexpr (BITS4 && NT == 4 && SPC <= 2) {
    if (M == 1) return kq_tile_m1x4<PLANES, SPC>(a, w, n0, y, bias);
  }
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (int j = 0; j < NT; ++j) kq_row<BITS4, SIGNED, SPC, 4, PLANES>(a, m, w, n0 + j, y, bias);
  for (int j = 0; j < NT; ++j) {
    switch (M - m) {
      case 3: kq_row<BITS4, SIGNED, SPC, 3, PLANES>(a, m, w, n0 + j, y, bias); break;
      case 2: kq_row<BITS4, SIGNED, SPC, 2, PLANES>(a, m, w, n0 + j, y, bias); break;
      case 1: kq_row<BITS4, SIGNED, SPC, 1, PLANES>(a, m, w, n0 + j, y, bias); break;
      default: break;
    }
  }
}
