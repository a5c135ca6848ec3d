// The data keys' choices (data.format, data.sampler), apart from the code that reads data, so
// that the recipe needs only these names.
#pragma once

#include <array>
#include <string_view>
#include <utility>

namespace t3d::runtime {

// data.format: text (a text file), bin (token files), auto (load_corpus's choice by extension).
enum class DataFormat { kAuto, kText, kBin };
inline constexpr std::array<std::pair<DataFormat, std::string_view>, 3> kDataFormatNames = {{
    {DataFormat::kAuto, "auto"},
    {DataFormat::kText, "text"},
    {DataFormat::kBin, "bin"},
}};

// data.sampler: the order rows are drawn in (runtime/data/data_sampler.h).
enum class SampleMode { kRandom, kSequential };
inline constexpr std::array<std::pair<SampleMode, std::string_view>, 2> kSampleModeNames = {{
    {SampleMode::kRandom, "random"},
    {SampleMode::kSequential, "sequential"},
}};

}  // namespace t3d::runtime
