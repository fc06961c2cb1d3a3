#include "common/model_dims.h"

#include "common/check.h"

namespace fsdp8 {

ModelDims ModelDimsOf(const v1::ModelConfig& m) {
  FSDP8_CHECK(m.n_heads() > 0) << "model.n_heads must be > 0";
  ModelDims d;
  d.d_model = m.d_model();
  d.n_heads = m.n_heads();
  d.n_kv_heads = m.n_kv_heads();
  d.head_dim = d.d_model / d.n_heads;
  d.ffn_dim = m.ffn_dim();
  d.vocab_size = m.vocab_size();
  d.seq_len = m.seq_len();
  d.n_layers = m.n_layers();
  return d;
}

}  // namespace fsdp8
