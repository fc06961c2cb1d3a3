// `fsdp8 plan SPEC --predict`: the cost model's predicted step time (common/cost_model.h) of a
// spec at one or more world sizes, printed for people or as JSON.
//
// Thread-safety: a function of its arguments that prints to stdout and stderr.
#pragma once

#include <string>
#include <vector>

#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

struct PredictFlags {
  std::string replicas;     // --replicas R ("" : the spec's sharding.replicas)
  std::string calibration;  // --calibration FILE ("" : DefaultCalibrationPath)
  bool json = false;        // --json: one JSON object per world size
};

// data/calibration/cpu.json for a "cpu" spec, data/calibration/cuda-h100.json for "cuda": the
// first that exists relative to the working directory, then to the executable's checkout
// (build/bin/fsdp8 -> ../../data/calibration).
std::string DefaultCalibrationPath(const std::string& backend);

// Resolves `spec` at each of `worlds` (sharding.min/max_workers set to it, sharding.replicas to
// flags.replicas when given), makes its mesh and prints the predicted step. Returns the exit
// status: 0, 2 for a bad flag, spec or calibration file (the message on stderr names it).
int PrintStepPrediction(const std::string& spec_path, const v1::JobSpec& spec,
                        const std::vector<int>& worlds, const PredictFlags& flags);

}  // namespace fsdp8
