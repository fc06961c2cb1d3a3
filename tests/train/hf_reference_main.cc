// fsdp8-hf-reference: fsdp8's side of the transformers reference check (tests/hf_reference/).
// Loads a Hugging Face directory (make_weights.py's: sharded safetensors with an index) into a
// one-rank CPU trainer with an all-FP32 precision plan, and on the directory's batch.json computes
// the logits, the mean next-token cross-entropy and its gradients (one backward). Writes the
// values a fixture (transformers_reference.py's JSON) holds, at the fixture's logit columns and
// gradient indices, in the fixture's layout, to --out.
//
// usage: fsdp8-hf-reference --hf DIR --fixture FIXTURE.json --out OUT.json
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "common/spec.h"
#include "absl/strings/str_cat.h"
#include "common/hf_model.h"
#include "tests/support/ranks.h"
#include "train/hf_import.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

absl::StatusOr<Struct> ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  Struct s;
  if (auto st = google::protobuf::util::JsonStringToMessage(ss.str(), &s); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", std::string(st.message())));
  }
  return s;
}

std::vector<int32_t> Flat(const Value& rows) {
  std::vector<int32_t> out;
  for (const Value& r : rows.list_value().values()) {
    for (const Value& v : r.list_value().values()) out.push_back(static_cast<int32_t>(v.number_value()));
  }
  return out;
}

v1::JobSpec ReferenceSpec(const v1::ModelConfig& model, int T, int B) {
  v1::JobSpec spec;
  spec.set_name("hf-reference");
  *spec.mutable_model() = model;
  spec.mutable_model()->set_seq_len(T);
  spec.mutable_data()->set_train_path(testing::MakeTokenFile("hf_reference.bin", 4096));
  spec.mutable_training()->set_steps(1);
  spec.mutable_training()->set_global_batch(B);
  spec.mutable_training()->set_microbatch(B);
  spec.mutable_optimizer()->set_warmup_steps(0);
  spec.mutable_sharding()->set_alignment(1);
  spec.set_backend("cpu");
  auto* p = spec.mutable_precision();
  p->set_linears(v1::PRECISION_FP32);
  p->set_embedding(v1::PRECISION_FP32);
  p->set_lm_head(v1::PRECISION_FP32);
  return spec;
}

// The outputs at the fixture's logit columns and gradient indices.
absl::StatusOr<Struct> Compute(Trainer& t, const Struct& fixture, const std::vector<int32_t>& in,
                               const std::vector<int32_t>& tg) {
  const int64_t V = t.spec().model().vocab_size();
  absl::StatusOr<std::vector<float>> logits = t.Logits(in);
  if (!logits.ok()) return logits.status();
  absl::StatusOr<std::vector<float>> losses = t.ForwardBackwardTokens(in, tg);
  if (!losses.ok()) return losses.status();
  absl::StatusOr<std::map<std::string, std::vector<float>>> grads = t.params().GatherAll(true);
  if (!grads.ok()) return grads.status();
  Struct out;
  auto& f = *out.mutable_fields();
  double loss = 0;
  for (float l : *losses) loss += l;
  f["loss"].set_number_value(loss / static_cast<double>(losses->size()));
  auto* rows = f["logits"].mutable_list_value();
  auto* lse = f["logsumexp"].mutable_list_value();
  const auto& cols = fixture.fields().at("logit_columns").list_value().values();
  for (size_t r = 0; r < in.size(); ++r) {
    const float* row = logits->data() + r * V;
    auto* out_row = rows->add_values()->mutable_list_value();
    for (const Value& c : cols) out_row->add_values()->set_number_value(row[static_cast<int64_t>(c.number_value())]);
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
    lse->add_values()->set_number_value(mx + std::log(sum));
  }
  auto& g_out = *f["grads"].mutable_struct_value()->mutable_fields();
  for (const auto& [name, want] : fixture.fields().at("grads").struct_value().fields()) {
    const std::string key = name == "lm_head.weight" && !grads->count(name) ? "model.embed_tokens.weight" : name;
    auto it = grads->find(key);
    if (it == grads->end()) return absl::NotFoundError(absl::StrCat("fsdp8 has no gradient of ", name));
    auto& e = *g_out[name].mutable_struct_value()->mutable_fields();
    auto* vals = e["values"].mutable_list_value();
    for (const Value& i : want.struct_value().fields().at("indices").list_value().values()) {
      vals->add_values()->set_number_value(it->second.at(static_cast<size_t>(i.number_value())));
    }
    double mx = 0, sq = 0;
    for (float g : it->second) {
      mx = std::max(mx, static_cast<double>(std::fabs(g)));
      sq += static_cast<double>(g) * g;
    }
    e["max_abs"].set_number_value(mx);
    e["l2"].set_number_value(std::sqrt(sq));
  }
  return out;
}

absl::Status Run(const std::string& hf, const std::string& fixture_path, const std::string& out_path) {
  absl::StatusOr<Struct> fixture = ReadJson(fixture_path);
  if (!fixture.ok()) return fixture.status();
  absl::StatusOr<Struct> batch = ReadJson(hf + "/batch.json");
  if (!batch.ok()) return batch.status();
  std::ifstream cf(hf + "/" + kHfConfigFile);
  std::stringstream cfg;
  cfg << cf.rdbuf();
  absl::StatusOr<v1::ModelConfig> model = ModelConfigFromHf(cfg.str());
  if (!model.ok()) return model.status();
  const std::vector<int32_t> in = Flat(batch->fields().at("input_ids"));
  const std::vector<int32_t> tg = Flat(batch->fields().at("targets"));
  const int B = batch->fields().at("input_ids").list_value().values_size();
  const int T = static_cast<int>(in.size()) / B;
  v1::JobSpec spec = ReferenceSpec(*model, T, B);
  spec.mutable_init()->set_from_hf(hf);
  absl::Status status;
  Struct result;
  testing::RunRanks(1, [&](int r, Communicator* c) {
    auto be = testing::CpuBackend();
    auto t = Trainer::Create(WithDefaults(spec, 1), r, 1, be.get(), c);
    if (!t.ok()) {
      status = t.status();
      return;
    }
    status = LoadHfWeights(t->get(), hf);
    if (!status.ok()) return;
    absl::StatusOr<Struct> s = Compute(**t, *fixture, in, tg);
    if (!s.ok()) status = s.status();
    else result = *s;
  });
  if (!status.ok()) return status;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(result, &json);
  std::ofstream(out_path, std::ios::trunc) << json;
  return absl::OkStatus();
}

}  // namespace
}  // namespace fsdp8

int main(int argc, char** argv) {
  std::string hf, fixture, out;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--hf") hf = argv[i + 1];
    else if (k == "--fixture") fixture = argv[i + 1];
    else if (k == "--out") out = argv[i + 1];
  }
  if (hf.empty() || fixture.empty() || out.empty()) {
    std::fprintf(stderr, "usage: fsdp8-hf-reference --hf DIR --fixture FIXTURE.json --out OUT.json\n");
    return 2;
  }
  const absl::Status s = fsdp8::Run(hf, fixture, out);
  if (!s.ok()) {
    std::fprintf(stderr, "fsdp8-hf-reference: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
