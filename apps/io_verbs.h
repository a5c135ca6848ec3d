// The verbs that move models and text in and out of titan3d without MPI, `tokenize` and `import`:
// they call runtime/ and print what they did (titan3d.cpp maps their errors to exit codes).
#pragma once

#include <string>

#include "runtime/use/tokenize.h"

namespace t3d::app {

int tokenize(const runtime::TokenizeOptions& o);
int import_model(const std::string& hf_dir, const std::string& out_dir);

}  // namespace t3d::app
