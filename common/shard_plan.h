// The shard plan: a deterministic function of (model config, precision plan, world size, alignment)
// and, for a hybrid-sharded job (common/mesh.h), of the mesh.
//
// Each FSDP unit ("embedding", "layers.<i>", "head" = final norm + LM head) holds its parameters in
// flat buffers, one per wire dtype (FP8 weights travel as uint8, the rest as bf16 or fp32). A
// buffer's tensors are laid out in a fixed order, then padded to a multiple of
// world_size * replicas * alignment elements; rank r owns elements [r * shard_numel, (r + 1) *
// shard_numel). For a mesh of R replicas x S ranks the plan is made at world_size = S (r is the
// shard index) with replicas = R, so that a group's shard splits into R whole pieces and the
// optimizer state's layout under OPTIMIZER_SHARDING_WORLD is that of a flat world-W plan. A flat
// job (R = 1) has the same plan as before meshes existed, bit for bit.
// Ranks whose slice is empty or all padding are legal (C05); unpadding round-trips exactly (C06).
//
// Thread-safety: pure functions and immutable values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mesh.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

enum class WireDtype { kFp8 = 0, kBf16 = 1, kFp32 = 2 };
const char* WireDtypeName(WireDtype d);  // "fp8", "bf16", "fp32"

// How a tensor is initialised (a function of the global element index and the seed, so the model
// is the same bits whatever the world size).
enum class Init {
  kOnes = 0,          // RMSNorm weights
  kNormal = 1,        // N(0, 1): token embedding (torch.nn.Embedding default)
  kKaimingUniform = 2 // U(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch.nn.Linear default weight init
};

struct TensorSpec {
  std::string name;            // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // e.g. {out_features, in_features} for a linear weight
  int64_t numel = 0;
  Init init = Init::kOnes;
  int64_t fan_in = 0;          // for kKaimingUniform
  uint64_t init_id = 0;        // distinct per tensor: seeds its initialisation stream
  bool is_fp8_linear = false;  // an FP8 GEMM weight (its buffer's wire dtype is kFp8)
};

// Rows per band of a blockwise FP8 wire buffer (BufferPlan::block_cols): one 128 x 128 block row.
inline constexpr int64_t kWireBandRows = 128;

struct BufferPlan {
  WireDtype wire = WireDtype::kFp32;
  // > 0: a blockwise FP8 wire buffer (precision.fp8.granularity BLOCKWISE): every tensor is a
  // linear weight of block_cols (K) columns, laid out in whole bands of kWireBandRows rows (its
  // rows padded with zeros up to a multiple of 128: its offset is a multiple of BandNumel()), and
  // each rank's shard holds whole bands (shard_numel a multiple of BandNumel()), so that no
  // 128 x 128 block nor its scale is split between ranks. numel counts the padded rows; each
  // tensor's numel stays rows x cols. The wire carries E4M3 codes plus one f32 scale_inv per
  // block (ScaleCols() per band, Backend's kBlock128 layout).
  int64_t block_cols = 0;
  std::vector<TensorSpec> tensors;
  std::vector<int64_t> offsets;  // element offset of each tensor in the flat buffer
  int64_t numel = 0;             // sum of tensor numels
  int64_t padded_numel = 0;      // multiple of world_size * replicas * alignment, >= numel
  int64_t shard_numel = 0;       // padded_numel / world_size

  // [begin, end) of rank r's slice in flat-buffer elements.
  int64_t ShardBegin(int rank) const { return rank * shard_numel; }
  int64_t ShardEnd(int rank) const { return (rank + 1) * shard_numel; }
  // One rank holds the whole buffer (world_size 1): its shard is the gathered buffer and the full
  // gradient its gradient shard, with no collective between them.
  bool OneRank() const { return shard_numel == padded_numel; }

  // Blockwise FP8 wire buffers (block_cols > 0).
  bool Banded() const { return block_cols > 0; }
  int64_t BandNumel() const { return kWireBandRows * block_cols; }
  int64_t ScaleCols() const { return (block_cols + 127) / 128; }  // blocks per band
  // The scale_inv index of the block row starting at element `offset` (a band boundary).
  int64_t ScaleOffset(int64_t offset) const { return offset / BandNumel() * ScaleCols(); }
  int64_t ShardScales() const { return Banded() ? ScaleOffset(shard_numel) : 0; }
  int64_t PaddedScales() const { return Banded() ? ScaleOffset(padded_numel) : 0; }
};

struct UnitPlan {
  std::string name;                   // "embedding", "layers.0", ..., "head"
  std::vector<BufferPlan> buffers;    // at most one per wire dtype, in WireDtype order
};

struct ShardPlan {
  int world_size = 1;  // ranks a buffer is sharded over (a mesh's shard group: S)
  int replicas = 1;    // R: copies of each shard (hybrid sharding); padding covers R x world_size
  int alignment = 1;
  std::vector<UnitPlan> units;  // embedding, layers.0 .. layers.{L-1}, head

  // Finds a tensor by name; returns false when absent.
  bool Find(const std::string& name, int* unit, int* buffer, int* tensor) const;
};

// Builds the plan for a spec with its defaults applied (ResolveSpec in common/spec.h, at any world
// size: checked with CheckDefaulted(spec, 0), never filled in here). Tensors (Hugging
// Face names, in this order): unit "embedding" = model.embed_tokens.weight (V, C) kNormal;
// unit "layers.i" = input_layernorm (C) kOnes, self_attn.{q (C, C), k (Hkv*hd, C), v (Hkv*hd, C),
// o (C, C)}_proj, post_attention_layernorm (C) kOnes, mlp.{gate (F, C), up (F, C), down (C, F)}_proj,
// linears kKaimingUniform with fan_in = in_features; unit "head" = model.norm.weight (C) kOnes,
// lm_head.weight (V, C) kKaimingUniform. With model.tie_word_embeddings there is no lm_head.weight:
// the head uses model.embed_tokens.weight, which is sharded once, in unit "embedding".
// Wire dtypes: a block's linears follow LayerLinearPrecision (FP8 -> kFp8, BF16 -> kBf16,
// FP32 -> kFp32; FP8 with a ROWWISE LayerGranularity -> kBf16, quantized at use); its two norms
// travel in fp32 when the linears are FP32, else in bf16. A BLOCKWISE block's linears go to
// blockwise FP8 wire buffers (BufferPlan::block_cols), one per distinct in_features (d_model: q,
// k, v, o, gate, up; ffn_dim: down; one buffer when they are equal), ahead of its norms' bf16
// buffer; such a buffer's padded_numel is world_size * replicas * ceil(bands / (world_size *
// replicas)) bands (sharding.alignment does not apply: a band is 128 x K elements). embedding
// and head (both tensors) follow precision.embedding / precision.lm_head (BF16 or FP32).
// padded_numel = ceil(numel / (world_size * alignment)) * world_size * alignment.
// init_id = FNV-1a 64 of the tensor name (stable across builds and world sizes).
// This overload is the flat plan over world_size ranks: sharding.replicas is not read.
// INVALID_ARGUMENT for world_size < 1, alignment < 1, non-positive model sizes or a spec without
// its defaults.
absl::StatusOr<ShardPlan> MakeShardPlan(const v1::JobSpec& spec, int world_size);
// The plan of a mesh: world_size = mesh.shard_size, replicas = mesh.replicas, padded_numel a
// multiple of mesh.world_size() * alignment (a flat mesh gives MakeShardPlan(spec, W)).
absl::StatusOr<ShardPlan> MakeShardPlan(const v1::JobSpec& spec, const Mesh& mesh);
// The layout of a checkpoint's `files` rank files (train/checkpoint.h): a flat plan over `files`
// ranks whose padding covers the spec's sharding.replicas (>= 1; 0 reads as 1) when its
// optimizer_sharding is SHARD_GROUP (one file per shard index), else files x alignment (WORLD:
// one file per rank, the layout of a flat world-W plan). What a reader of a checkpoint's master
// weights plans with (a checkpoint of a flat job: MakeShardPlan(spec, files)).
absl::StatusOr<ShardPlan> MakeCheckpointShardPlan(const v1::JobSpec& spec, int files);
// Same, from an explicit tensor list per unit (used by tests for odd sizes such as 57 elements):
// units[u] = {name, lists}, where lists[d] holds the tensors of wire dtype WireDtype(d) (at most 3
// lists; empty lists and zero-element buffers produce no buffer). A tensor's numel is the product of
// its shape when 0; an empty shape becomes {numel}; init_id 0 becomes the name hash.
// replicas: padding to world_size * replicas * alignment (a mesh's plan, see above).
// INVALID_ARGUMENT for world_size < 1, replicas < 1, alignment < 1, more than 3 lists, a negative
// dimension, numel != product of shape, or a duplicate tensor name.
absl::StatusOr<ShardPlan> MakeShardPlan(const std::vector<std::pair<std::string,
                                        std::vector<std::vector<TensorSpec>>>>& units,
                                        int world_size, int alignment, int replicas = 1);

// The plan as the AdminService reports it.
v1::ShardPlan ToProto(const ShardPlan& plan);

// Copies rank r's slice of a full unpadded buffer `full` (numel) into `shard` (shard_numel),
// padding with zeros; and gathers shards back. Unpad(Pad(x)) == x bit for bit. Element type T.
template <typename T>
void ExtractShard(const BufferPlan& b, int rank, const T* full, T* shard) {
  for (int64_t i = 0; i < b.shard_numel; ++i) {
    int64_t g = b.ShardBegin(rank) + i;
    shard[i] = g < b.numel ? full[g] : T(0);
  }
}
// full (numel) from the concatenation of all ranks' shards `gathered` (padded_numel).
template <typename T>
void Unpad(const BufferPlan& b, const T* gathered, T* full) {
  for (int64_t i = 0; i < b.numel; ++i) full[i] = gathered[i];
}

// The initial value of element `index` (row-major, within the tensor) of tensor `t` under `seed`:
// a pure function (counter-based RNG), identical whatever the world size. With
// h = SplitMix64(SplitMix64(SplitMix64(seed) ^ init_id) ^ index) (token_shard.h):
//   kOnes: 1;  kKaimingUniform: (2u - 1) / sqrt(fan_in), u = (h >> 11) * 2^-53 in [0, 1);
//   kNormal: Box-Muller sqrt(-2 ln u1) cos(2 pi u2), u1 = ((h >> 11) + 0.5) * 2^-53,
//            u2 = (SplitMix64(h) >> 11) * 2^-53; computed in double, rounded to float.
float InitValue(const TensorSpec& t, int64_t index, uint64_t seed);

}  // namespace fsdp8
