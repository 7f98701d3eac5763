// The dispatch of the int8 block products onto one vector width's tiles: included by quant_linear.cpp
// once per width, inside that width's namespace (zmm: the AVX512-VNNI tiles, PERFXLM_ZMM_TILES 1; ymm:
// dots256.h's, PERFXLM_ZMM_TILES 0), after the tiles it calls (block_tile, kq_rows, ...). Each width's
// `products` runs every layout the block GEMV takes; quant_linear.cpp's block_into picks the width.
// No include guard: included twice in AVX-512 VNNI builds, by design.

// All rows of a two-level weight, in parallel over tiles of four rows (over_rows' split, no expansion).
template <bool BITS4, bool SIGNED, int SPC, int PLANES>
void kq_gemv_typed(const BlockActs& a, int64_t M, const QW& w, float* y, const float* bias) {
  at::parallel_for(0, (w.N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    const int64_t n1 = std::min(w.N, end * 4);
    int64_t n = begin * 4;
    for (; n + 4 <= n1; n += 4) kq_rows<BITS4, SIGNED, SPC, 4, PLANES>(a, M, w, n, y, bias);
    for (; n < n1; ++n) kq_rows<BITS4, SIGNED, SPC, 1, PLANES>(a, M, w, n, y, bias);
  });
}

// The block product of a weight kq_takes.
void kq_product(const BlockActs& a, int64_t M, const QW& w, float* y, const float* bias, int spc) {
  if (!w.bits4)
    kq_gemv_typed<false, true, 4, 0>(a, M, w, y, bias);
  else if (w.bits6)
    kq_gemv_typed<true, true, 4, 2>(a, M, w, y, bias);
  else if (w.bits5)
    kq_gemv_typed<true, false, 2, 1>(a, M, w, y, bias);
  else if (spc == 2)
    kq_gemv_typed<true, false, 2, 0>(a, M, w, y, bias);
  else
    kq_gemv_typed<true, false, 1, 0>(a, M, w, y, bias);
}

// Activation rows per pass over a tile of weight rows. A pass loads and unpacks each weight row's codes
// once and multiplies them into every activation row it holds, so the unpacking is paid once per pass:
// a verification step's 5-8 rows (a decode row and its guesses) ran as a pass of 4 and one of the rest,
// every code unpacked twice (an extra row cost ~37 % of a one-row step). The widest pass whose
// accumulators stay in registers: zmm (32 registers) keep MT x NT of them, so 5-8 rows take two weight
// rows at a time (block_tile_wide) and at most 4 rows the tile of four; ymm (16) run one weight row at a time with
// MT accumulators, 2 MT for 8-bit codes at groups of 16 (two per chunk), which stay at 4 rows.
// Each row's sums run in block_tile's order whatever the pass's width: a row alone gives the bits of the
// same row in any batch (speculative verification's exactness rests on it).
#if PERFXLM_ZMM_TILES
template <bool BITS4, int SPC>
constexpr int64_t kWideRows = 8;
#else
template <bool BITS4, int SPC>
constexpr int64_t kWideRows = (!BITS4 && SPC == 4) ? 4 : 8;
#endif

// One pass of MT activation rows over the NT weight rows from n0 (see kWideRows).
template <bool BITS4, bool HALF, int SPC, int MT, int NT, int PLANES>
inline void row_pass(const BlockActs& a, int64_t m0, const QW& w, int64_t n0, float* y, const float* bias) {
#if PERFXLM_ZMM_TILES
  if constexpr (MT > 4 && NT % 2 == 0) {
    #pragma GCC unroll 4
    for (int j = 0; j < NT; j += 2) block_tile_wide<BITS4, HALF, SPC, MT, PLANES>(a, m0, w, n0 + j, y, bias);
    return;
  }
#endif
  block_tile<BITS4, HALF, SPC, MT, NT, PLANES>(a, m0, w, n0, y, bias);
}

// The last `rows` (1..MT) activation rows from m0, as one pass.
template <bool BITS4, bool HALF, int SPC, int MT, int NT, int PLANES>
inline void rows_left(const BlockActs& a, int64_t rows, int64_t m0, const QW& w, int64_t n0, float* y,
                      const float* bias) {
  if constexpr (MT >= 1) {
    if (rows == MT) return row_pass<BITS4, HALF, SPC, MT, NT, PLANES>(a, m0, w, n0, y, bias);
    rows_left<BITS4, HALF, SPC, MT - 1, NT, PLANES>(a, rows, m0, w, n0, y, bias);
  }
}

template <bool BITS4, bool HALF, int SPC, int NT, int PLANES>
inline void block_rows(const BlockActs& a, int64_t M, const QW& w, int64_t n0, float* y, const float* bias) {
#if !PERFXLM_ZMM_TILES
  if constexpr (NT == 4 && BITS4 && SPC <= 2) {
    if (M == 1) return block_tile_m1x4<BITS4, HALF, SPC, PLANES>(a, 0, w, n0, y, bias);
  }
  if constexpr (NT == 4 && !BITS4 && SPC <= 2) {
    if (M == 1) return block_tile_m1x4_q8<HALF, SPC>(a, 0, w, n0, y, bias);
  }
#endif
  constexpr int64_t wide = kWideRows<BITS4, SPC>;
  int64_t m = 0;
  for (; m + wide <= M; m += wide) row_pass<BITS4, HALF, SPC, wide, NT, PLANES>(a, m, w, n0, y, bias);
  if (m < M) rows_left<BITS4, HALF, SPC, wide - 1, NT, PLANES>(a, M - m, m, w, n0, y, bias);
}

template <bool BITS4, bool HALF, int SPC, int PLANES>
void block_gemv_typed(const BlockActs& a, int64_t M, const QW& w, float* y, const float* bias) {
  over_rows(w, 4, 16, [&](const QW& v, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) block_rows<BITS4, HALF, SPC, 4, PLANES>(a, M, v, n, y, bias);
    for (; n < n1; ++n) block_rows<BITS4, HALF, SPC, 1, PLANES>(a, M, v, n, y, bias);
  });
}

template <bool BITS4, bool HALF, int PLANES = 0>
void block_gemv_spc(const BlockActs& a, int64_t M, const QW& w, float* y, const float* bias, int spc) {
  if (spc == 1) block_gemv_typed<BITS4, HALF, 1, PLANES>(a, M, w, y, bias);
  else if (spc == 2) block_gemv_typed<BITS4, HALF, 2, PLANES>(a, M, w, y, bias);
  else if constexpr (!BITS4 || PLANES == 2) block_gemv_typed<BITS4, HALF, 4, PLANES>(a, M, w, y, bias);  // 8- or 6-bit
}

// The block products of M quantized rows `a` with every row of w into y [M, w.N], on this width's tiles.
void products(const BlockActs& a, int64_t M, const QW& w, float* yp, const float* bias, int spc) {
  if (kq_takes(w, spc))
    kq_product(a, M, w, yp, bias, spc);
  else if (w.bits6)  // the planes a template argument: no branch on them per chunk
    w.half ? block_gemv_spc<true, true, 2>(a, M, w, yp, bias, spc) : block_gemv_spc<true, false, 2>(a, M, w, yp, bias, spc);
  else if (w.bits5)
    w.half ? block_gemv_spc<true, true, 1>(a, M, w, yp, bias, spc) : block_gemv_spc<true, false, 1>(a, M, w, yp, bias, spc);
  else if (w.bits4)
    w.half ? block_gemv_spc<true, true>(a, M, w, yp, bias, spc) : block_gemv_spc<true, false>(a, M, w, yp, bias, spc);
  else
    w.half ? block_gemv_spc<false, true>(a, M, w, yp, bias, spc) : block_gemv_spc<false, false>(a, M, w, yp, bias, spc);
}
