// Plain-data interface between the torch-facing binding TU and the per-ISA
// kernel TUs. Deliberately free of torch headers: the ISA TUs are compiled
// with wider target flags and should pull in as little shared inline code as
// possible (see isa.h for why).
#pragma once
#include <cstdint>

namespace kv_cconv {

enum class DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

constexpr int kMaxWidth = 6;
// Channels per work item. Multiple of the widest channel group (2 x 16
// floats with AVX-512) so only the last tile of a row can be ragged. Wide
// tiles make the access pattern nearly row-contiguous; 2048 keeps the
// per-item fp32 tap/window buffers (~64 KiB for W=4) on the stack.
#ifndef KV_TILE_C
#define KV_TILE_C 2048
#endif
constexpr int64_t kTileC = KV_TILE_C;
// A tile narrower than kTileC (the call's tiles made equal) starts on this many channels: whole
// channel groups of every build.
constexpr int64_t kTileAlign = 64;

// One sequence of the batch (fwd) or one batch row (update).
struct Seq {
  int64_t x_off;    // element offset of time row 0 in x
  int64_t out_off;  // element offset of time row 0 in out
  int64_t len;      // number of time rows
  int64_t slot;     // state slot, or -1 for "no state row" / pad
  int64_t hist_row; // update: first history row within the slot
  int64_t shift;    // update: rows the slot is shifted by
  int64_t item0;    // fwd: index of this sequence's first chunk in a tile
  bool pad;         // output zero, state untouched
  bool init;        // fwd: read history from the state
};

struct Params {
  DType dtype;      // x / out / state element type
  DType wdtype;     // weight element type
  DType bdtype;     // bias element type
  int32_t width;    // W
  bool silu;
  int64_t dim;      // D
  const void* x;
  void* out;
  const void* weight;
  int64_t w_sd, w_sk;  // weight strides (channel, tap)
  const void* bias;    // may be null
  int64_t b_sd;
  int64_t x_rs;        // x stride between time rows
  int64_t out_rs;
  void* state;         // may be null
  int64_t st_sn, st_ss, st_sd, st_rows;  // strides (slot, row, channel), S
  const Seq* seqs;
  int64_t nseq;
  int64_t chunk_t;     // fwd: time rows per item; update: batch rows per item
  int64_t n_tiles;     // channel tiles per row
  int64_t tile_c;      // channels per tile (<= kTileC, a multiple of kTileAlign); the last may be narrower
  int64_t items_per_tile;  // fwd: sum over sequences of their time chunks
  bool chunk_major;    // fwd: items numbered chunk-major (below), else tile-major
  bool block_path;     // fwd: alias-safe block path allowed (not in place,
                       // x small enough to be cache-resident)
};

// Work-range entry points, one set per ISA build. Items are numbered
//  fwd, tile-major:  tile * items_per_tile + seq.item0 + chunk
//  fwd, chunk-major: (seq.item0 + chunk) * n_tiles + tile
//  update: (batch row / chunk_t) * n_tiles + tile
using RangeFn = void (*)(const Params&, int64_t begin, int64_t end);

}  // namespace kv_cconv
