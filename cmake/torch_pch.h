// Precompiled header: LibTorch is the slowest thing to parse in this project.
#pragma once
#include <torch/torch.h>
#include <string>
#include <vector>
#include <map>
