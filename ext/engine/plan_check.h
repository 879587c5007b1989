// Checks shared by the CPU engine (engine.cpp) and the GPU engine (ext/gpu/engine_gpu.cu): the
// model config and engine options once at construction, the step plan before each step, and the
// lane grouping both executors run on. Host code only, compiled by g++ and linked into the module
// beside the .cu files, so this header stays free of anything nvcc or hipcc cannot compile.
//
// Every check throws std::invalid_argument with the messages the engines have always raised
// (step plan errors carry the "step plan: " prefix); a failed step check leaves no state changed.
#pragma once

#include <cstdint>

#include "engine.h"

namespace ds4 {

// The config checks both engines need, in two halves so each engine can put its own kernel
// limits between (CPU) or after (GPU) them and keep the order its messages always came in.
// Per-layer tables, compress ratios, sliding window and rope_dim.
void check_config_layers(const ModelConfig& c);
// Heads, experts, indexer, QAT constraints and the engine options.
void check_config_shapes(const ModelConfig& c, const EngineOptions& o);

// Validates a step's lanes and block tables against the options: lane count, table slots (each
// at most once), page ids in -1..n_pages-1 and none beyond stride (the engine's blocks per slot),
// every lane's slot has a table row, tokens in the vocabulary, positions below max_ctx, and no
// page named by two slots (slots attend in parallel). page_owner: n_pages ints of scratch.
void check_step_plan(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
                     int n_tables, const int32_t* table_slot, const int32_t* block_table, int max_blocks,
                     const EngineOptions& o, int n_vocab, int stride, int32_t* page_owner);

// Groups lanes by slot in first-appearance order, keeping lane order inside a slot; a slot's
// positions must run consecutively (throws otherwise). Fills order (lanes by group) and per group
// group_first (into order), group_len, group_slot; lane_group and lane_t0 (each lane's group and
// its group's first position) only where not null. Returns the number of groups.
int group_lanes(int n_lanes, const int32_t* lane_slot, const int32_t* lane_pos, int32_t* order, int32_t* group_first,
                int32_t* group_len, int32_t* group_slot, int32_t* lane_group, int32_t* lane_t0);

// Copies a step's (validated) block-table rows into the engine's tables [slot][stride], padding
// each row past max_blocks with -1.
void copy_block_tables(int n_tables, const int32_t* table_slot, const int32_t* block_table, int max_blocks,
                       int32_t* tables, int stride);

// Every page a lane will read or write must be assigned in tables [slot][stride]: the last
// logical page holding a compressed entry visible at the lane's position (csa/hca: whether the
// model has ratio-4 / ratio-128 layers), and all before it.
void check_pages(int n_lanes, const int32_t* lane_slot, const int32_t* lane_pos, bool csa, bool hca,
                 const int32_t* tables, int stride);

}  // namespace ds4
