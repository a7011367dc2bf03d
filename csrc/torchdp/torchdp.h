#pragma once

/// The whole public API of torchdp: data parallelism over one process's devices (see README.md).
#include <torchdp/autograd.h>
#include <torchdp/comm.h>
#include <torchdp/config.h>
#include <torchdp/data_parallel.h>
#include <torchdp/devices.h>
#include <torchdp/hooks.h>
#include <torchdp/parallel_apply.h>
#include <torchdp/replicate.h>
#include <torchdp/script_module.h>
#include <torchdp/shares.h>
#include <torchdp/structure.h>
