// fsdp8-hf-eval: loads a Hugging Face directory (as `fsdp8 export` writes it) into a one-rank CPU
// trainer through init.from_hf, computes fsdp8's mean cross-entropy (nats per token) on one
// validation batch of a token shard, and writes the batch and the loss to DIR/fsdp8_val_batch.json
// so that another implementation (tests/gpu/hf_check.py with transformers) can compare.
//
// The batch is validation batch 0 of the data rule (seed, stream kValidationStream): `batch`
// sequences of seq_len input tokens and their seq_len next-token targets. The loss is computed with
// an all-FP32 precision plan (embedding, linears, LM head), the math of a float32 PyTorch model;
// --fp8 also reports the loss under the default FP8 plan of the same weights.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/flags_help.h"
#include "common/hf_model.h"
#include "common/spec.h"
#include "common/token_shard.h"
#include "kernels/backend.h"
#include "train/data.h"
#include "comm/gloo_communicator.h"
#include "train/hf_import.h"
#include "comm/kv_store.h"
#include "train/trainer.h"

ABSL_FLAG(std::string, hf, "", "Hugging Face model directory (config.json + model.safetensors)");
ABSL_FLAG(std::string, tokens, "", "llm.c token shard (.bin) to take the validation batch from");
ABSL_FLAG(int, batch, 4, "sequences in the batch");
ABSL_FLAG(int, seq_len, 0, "tokens per sequence; default config.json max_position_embeddings");
ABSL_FLAG(uint64_t, seed, 1234, "data-rule seed");
ABSL_FLAG(bool, fp8, false, "also compute the loss under the default FP8 precision plan");
ABSL_FLAG(std::string, out, "", "output file; default HF_DIR/fsdp8_val_batch.json");

namespace {

// A one-process rendezvous store (world size 1 needs no peers).
class LocalKvStore : public fsdp8::KvStore {
 public:
  absl::Status Set(const std::string& k, const std::string& v) override {
    absl::MutexLock l(&mu_);
    kv_[k] = v;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& k, std::chrono::milliseconds) override {
    absl::MutexLock l(&mu_);
    auto it = kv_.find(k);
    if (it == kv_.end()) return absl::DeadlineExceededError(absl::StrCat("key ", k));
    return it->second;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> kv_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<double> Loss(const fsdp8::v1::JobSpec& spec, const std::string& hf) {
  LocalKvStore kv;
  auto comm = fsdp8::GlooCommunicator::Create(0, 1, &kv, "eval/", "127.0.0.1",
                                              std::chrono::seconds(30));
  if (!comm.ok()) return comm.status();
  std::string err;
  auto be = fsdp8::CreateBackend("cpu", 0, &err);
  if (!be) return absl::InternalError(err);
  absl::StatusOr<fsdp8::v1::JobSpec> resolved = fsdp8::ResolveSpec(spec, 1, {}, false);
  if (!resolved.ok()) return resolved.status();
  auto t = fsdp8::Trainer::Create(*resolved, 0, 1, be.get(), comm->get());
  if (!t.ok()) return t.status();
  if (absl::Status s = fsdp8::LoadHfWeights(t->get(), hf); !s.ok()) return s;
  return (*t)->Evaluate();
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "fsdp8-hf-eval: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp8::ParseOnOffFlags("train/hf_eval_main.cc", argc, argv);
  absl::ParseCommandLine(argc, argv);
  const std::string hf = absl::GetFlag(FLAGS_hf), tokens = absl::GetFlag(FLAGS_tokens);
  if (hf.empty() || tokens.empty()) {
    std::fprintf(stderr, "usage: fsdp8-hf-eval --hf DIR --tokens FILE.bin [--batch 4] "
                         "[--seq_len T] [--seed 1234] [--fp8] [--out FILE]\n");
    return 2;
  }
  std::FILE* cf = std::fopen((hf + "/" + fsdp8::kHfConfigFile).c_str(), "rb");
  if (!cf) return Fail(absl::NotFoundError(hf + "/config.json: cannot read"));
  std::string cfg;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), cf)) > 0;) cfg.append(buf, n);
  std::fclose(cf);
  auto model = fsdp8::ModelConfigFromHf(cfg);
  if (!model.ok()) return Fail(model.status());
  const int B = absl::GetFlag(FLAGS_batch);
  const int T = absl::GetFlag(FLAGS_seq_len) > 0 ? absl::GetFlag(FLAGS_seq_len) : model->seq_len();
  const uint64_t seed = absl::GetFlag(FLAGS_seed);

  fsdp8::v1::JobSpec spec;
  spec.set_name("hf-eval");
  *spec.mutable_model() = *model;
  spec.mutable_model()->set_seq_len(T);
  spec.mutable_data()->set_train_path(tokens);
  spec.mutable_data()->set_val_path(tokens);
  spec.mutable_training()->set_steps(1);
  spec.mutable_training()->set_global_batch(B);
  spec.mutable_training()->set_microbatch(B);
  spec.mutable_training()->set_seed(seed);
  spec.mutable_training()->set_eval_batches(1);
  spec.mutable_optimizer()->set_warmup_steps(0);
  spec.set_backend("cpu");
  spec.mutable_init()->set_from_hf(hf);
  fsdp8::v1::JobSpec fp32 = spec;
  fp32.mutable_precision()->set_linears(fsdp8::v1::PRECISION_FP32);
  fp32.mutable_precision()->set_embedding(fsdp8::v1::PRECISION_FP32);
  fp32.mutable_precision()->set_lm_head(fsdp8::v1::PRECISION_FP32);

  auto loss = Loss(fp32, hf);
  if (!loss.ok()) return Fail(loss.status());
  absl::StatusOr<double> loss_fp8 = absl::UnavailableError("not computed");
  if (absl::GetFlag(FLAGS_fp8)) {
    loss_fp8 = Loss(spec, hf);
    if (!loss_fp8.ok()) return Fail(loss_fp8.status());
  }

  // The validation batch Evaluate read: the job's default sampling (EPOCH), batch 0.
  auto data = fsdp8::TokenData::Load(tokens, T, model->vocab_size(), B, fsdp8::Sampling::kEpoch);
  if (!data.ok()) return Fail(data.status());
  std::vector<int32_t> in(static_cast<size_t>(B) * T), tg(in.size());
  absl::Status read = (*data)->Batch(seed, 0, 0, B, fsdp8::kValidationStream, in.data(), tg.data());
  if (!read.ok()) return Fail(read);

  google::protobuf::Struct out;
  auto& f = *out.mutable_fields();
  auto rows = [&](const std::vector<int32_t>& v, const char* key) {
    auto* list = f[key].mutable_list_value();
    for (int b = 0; b < B; ++b) {
      auto* row = list->add_values()->mutable_list_value();
      for (int t = 0; t < T; ++t) row->add_values()->set_number_value(v[b * T + t]);
    }
  };
  rows(in, "input_ids");
  rows(tg, "targets");
  f["loss"].set_number_value(*loss);
  f["loss_unit"].set_string_value("mean cross-entropy over batch x seq_len targets, nats per token");
  f["precision"].set_string_value("fp32 (embedding, linears, lm_head)");
  if (loss_fp8.ok()) f["loss_fp8_plan"].set_number_value(*loss_fp8);
  f["tokens_file"].set_string_value(tokens);
  f["seed"].set_number_value(static_cast<double>(seed));
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(out, &json);
  const std::string path =
      absl::GetFlag(FLAGS_out).empty() ? hf + "/fsdp8_val_batch.json" : absl::GetFlag(FLAGS_out);
  std::FILE* of = std::fopen(path.c_str(), "wb");
  if (!of || std::fwrite(json.data(), 1, json.size(), of) != json.size() || std::fclose(of) != 0) {
    return Fail(absl::InternalError("writing " + path));
  }
  std::printf("fsdp8 loss %.6f nats/token (fp32 plan)", *loss);
  if (loss_fp8.ok()) std::printf(", %.6f (FP8 plan)", *loss_fp8);
  std::printf(" on %d x %d tokens; wrote %s\n", B, T, path.c_str());
  return 0;
}
