// Greedy speculative decoding with a DFlash drafter (docs/recipe.md#speculative-decoding), round
// for round the same as z-lab's `dflash_generate` at temperature 0, so output ids AND per-round
// acceptance lengths can be compared exactly. Legend: S = accepted sequence length (prompt +
// generated), V = verify size (tokens of one block, <= B; dspark: <= B + 1), H = hidden size, K = captured target
// layers, B = block size.
//
// One prompt (max_length = prompt + max_new_tokens):
//   prefill: the target runs over the prompt; first token = argmax lm_head(final_norm(h_last[-1]));
//            context = the captured target features (drafter.target_layer_ids) of every prompt row.
//   rounds, while start + 1 < max_length and no stop token was produced (start = index of the last
//   accepted token, initially the prompt length):
//     V = min(B, max_length - start); block = [seq[start], MASK x (V-1)] at positions start..start+V-1;
//     the drafter sees the fused context of positions 0..start-1 and the block; drafts = argmax of
//     lm_head(drafter hidden) at block rows 1..V-1;
//     the target verifies the block [seq[start], drafts] (appended to its cache, which holds
//     seq[0..start-1]); posterior[i] = target argmax at block row i;
//     acceptance a = longest prefix with drafts[i] == posterior[i]; bonus = posterior[a];
//     produced = min(a + 1, max_length - start - 1), cut after the first stop token among the
//     produced tokens (which then ends decoding); acceptance_lengths gets `produced`;
//     the target's cache is truncated to seq[0..start+produced-1] (rejected drafts dropped);
//     the context grows by the target features of block rows 0..produced-1; start += produced.
//   output = generated tokens seq[prompt .. min(start + 1, max_length)) (a stop token is included).
// With B == 1 there is no drafting (the target emits one token per round), as in z-lab.
//
// Methods (DrafterConfig::method; the walks inside a block: core/eval/successor_draft.h). B is the
// number of drafts per round plus one for dflash and dflash2 (their anchor row predicts nothing), and
// the number of drafts per round for dspark, whose every row predicts; verify_width() below:
//   dflash   as above (this path is the z-lab-exact one).
//   dflash2  the same rounds and block, the drafts chosen by the candidate-selector walk over rows
//            1..V-1 instead of each row's own argmax.
//   dspark   V = min(B + 1, max_length - start) (>= 2 whenever a round runs); the drafter's block is
//            [seq[start], MASK x (V-2)], V-1 rows at positions start..start+V-2, and row k drafts
//            token start+k+1 (the Markov walk); the target verifies [seq[start], drafts] (V rows),
//            and the acceptance, bonus, caps and stop tokens follow the rule above, so a round
//            produces up to B+1 tokens. The confidence head does not cut the draft: every round
//            verifies all V-1 drafts (a static verify length, as SGLang's static verify mode;
//            speculators 0.9.0 has no inference loop of its own).
//
// Sampling (SpecDecodeOptions::sampling.temperature > 0): the standard speculative sampling rule,
// so that the generated tokens follow the target's own sampling distribution exactly. p = the
// target's and q = the drafter's distribution at each block row, both after temperature, top-k and
// top-p (model::sampling_probs, core/model/generation.h). Per round and prompt, all from the
// prompt's own generator (seeded SpecDecodeOptions::seed + its index in the call, on the target's
// device), in this order:
//   drafts x_i ~ q_i (rows 1..V-1 of the drafter, i = 0..V-2; dspark and dflash2: drawn one after
//     the other by the walk, q_i given the drafts before it, dflash2's q_i zero outside its candidates);
//   u_i ~ U[0, 1); draft i is accepted iff u_i q_i(x_i) < p_i(x_i) (probability min(1, p/q));
//   correction c_i ~ max(0, p_i - q_i) normalized (p_i itself when that is all zero, i.e. p_i <= q_i
//     everywhere, which can only differ from p_i == q_i by rounding), bonus c_{V-1} ~ p_{V-1};
//   a = the first rejected i (V-1 when none); produced tokens = x_0..x_{a-1}, c_a, then the same
//   caps and stop tokens as above. The first token (prefill) is drawn from p.
// Every draw is argmax(w / E) with E ~ Exp(1) per token (a draw proportional to the weights w).
// The result of a prompt depends only on its seed, not on the batch (up to floating-point
// reassociation). Cost: the probabilities of every verified row, [rows, vocab] fp32, and two host
// reads per round.
//
// Batching (SpecDecodeOptions::batch_size = S >= 1): up to S prompts decode at once, one slot each
// of ONE model::SequenceCache (slots sized longest prompt + max_new_tokens); a prompt that finishes
// hands its slot to the next waiting one (in input order). Each iteration prefills the newly
// admitted prompts in one target extend, then runs one round for every running prompt: the
// drafter drafts the blocks of all of them in one forward per distinct verify size V (blocks of
// different V cannot share a forward, since Drafter rows come in blocks of its block_size), the
// target verifies all blocks in ONE extend (per-slot lengths V_i), and one truncate rolls every
// slot back to its own accepted prefix. Each prompt follows exactly the round rule above, so its
// ids and acceptance lengths do not depend on the batch (up to floating-point reassociation of
// batched kernels; fp32 CPU runs are equal, which the tests check for S = 1 and 3).
//
// Cost: the target runs incrementally: V tokens per prompt per round over its KV / recurrent
// cache, rolled back to the accepted prefix after each round. The drafter keeps the K/V of every
// slot's context in a model::DrafterContextCache (core/model/drafter_context_cache.h; slots sized
// like the target's): each round projects only the block rows and the rows it keeps (the kept rows
// of all slots gathered by one index_select, fused and projected in one call), for drafts equal to
// Drafter::forward over the whole context (up to floating-point reassociation: the rows are
// projected in other batches). Every path takes it (greedy, sampling, uncached_target). One host
// read per round (the posteriors of all blocks) plus one per drafter forward.
//
// Contracts: the drafter must fit the target (hidden size, target_layer_ids within the target's
// layers, mask_token_id and prompt ids within the vocabulary): ConfigError / DataError otherwise.
// Not thread-safe (the target is stateful).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/drafter_context_cache.h"
#include "core/model/generation.h"
#include "core/model/target.h"

namespace dflash::eval {

struct SpecDecodeOptions {
  int64_t max_new_tokens = 64;          // >= 1
  int64_t block_size = 0;               // 0: the drafter's block_size; >= 1 otherwise
  std::vector<int64_t> stop_token_ids;  // empty: stop only at max_new_tokens
  int64_t batch_size = 1;               // >= 1: prompts decoded at once (cache slots)
  model::SamplingOptions sampling;      // temperature 0: greedy (exact vs z-lab); > 0: speculative sampling
  uint64_t seed = 0;                    // sampling: prompt i of a call draws from a generator seeded seed + i
  // A deliberately WRONG sampling rule that keeps every draft: only the distribution test's
  // negative control sets it (its samples must fail the test's bound). Ignored when greedy.
  bool accept_every_draft = false;
  // The uncached reference (a benchmark baseline only, `dflash bench generate --eval`): no target
  // cache; the target re-runs each prompt's whole sequence (accepted tokens + the block) every
  // round, as dflash eval did before the cache. The same rounds and results (up to floating-point
  // differences between the full forward and the cached extend). The drafter keeps its context
  // cache either way (this switch is about the target).
  bool uncached_target = false;
  // Called in every round with the prompt's index in the call and the drafts the target verifies
  // (empty when V == 1), before the verification (reference comparisons); empty: nothing is called.
  std::function<void(size_t, const std::vector<int64_t>&)> on_drafts;
  // Called after each prompt of a generate_batch call finishes, with the number finished so far
  // in that call (progress lines); empty: nothing is called.
  std::function<void(int64_t)> on_prompt_done;
};

struct SpecDecodeResult {
  std::vector<int64_t> output_ids;          // generated tokens only
  std::vector<int64_t> acceptance_lengths;  // tokens produced per round (z-lab's acceptance_lengths)
};

class SpeculativeDecoder {
 public:
  // Keeps references to `target` and a working copy of the drafter's weights in the target's dtype
  // on the target's device (the drafter's own fp32 masters are not touched).
  SpeculativeDecoder(model::TargetModel& target, const model::Drafter& drafter);
  // One prompt (opt.batch_size is irrelevant). ConfigError for max_new_tokens < 1 or block_size
  // < 0; DataError for an empty prompt or a token outside the vocabulary.
  SpecDecodeResult generate(const std::vector<int64_t>& prompt, const SpecDecodeOptions& opt);
  // Every prompt, batched as described above; results in prompt order. Errors as generate() (also
  // ConfigError for batch_size < 1), every prompt checked before any work; no prompts: no results.
  std::vector<SpecDecodeResult> generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                               const SpecDecodeOptions& opt);

 private:
  // Drafter::forward treats its rows as blocks of config().block_size, so each block of `rows` rows
  // (V for dflash / dflash2, V-1 for dspark) gets a drafter whose block_size is `rows`; all of them
  // share the same weight tensors (built once per size). DFlash2 with more convolution taps than
  // rows keeps the first `rows` taps (the others never reach a row of the block).
  const model::Drafter& drafter_for(int64_t rows);
  struct Slot;  // one running prompt
  // The target over `ids` (lengths[j] tokens for slot which[j], back to back) following the first
  // held[j] accepted tokens of each slot: an extend of `cache`, or without a cache (null,
  // SpecDecodeOptions::uncached_target) one full forward per slot. Captures of the appended rows.
  model::CaptureResult append(model::SequenceCache* cache, const std::vector<Slot>& slots,
                              const std::vector<int64_t>& which, const std::vector<int64_t>& held,
                              const std::vector<int64_t>& lengths, const std::vector<int64_t>& ids, bool rollback);
  // Admits waiting prompts into free slots: one prefill extend, their first tokens and contexts.
  // `context`: the drafter's context cache, null when B == 1 (no drafting).
  void admit(model::SequenceCache* cache, model::DrafterContextCache* context, std::vector<Slot>& slots,
             const std::vector<std::vector<int64_t>>& prompts, size_t& next, int64_t B, const SpecDecodeOptions& opt);
  // One round (draft, verify, accept, roll back) for every running slot.
  void round(model::SequenceCache* cache, model::DrafterContextCache* context, std::vector<Slot>& slots, int64_t B,
             const SpecDecodeOptions& opt);
  // Appends counts[j] context rows to slot which[j] of `context`: the target features features_TKH
  // of all of them back to back, fused in one call.
  void append_context(model::DrafterContextCache& context, int64_t B, const std::vector<int64_t>& which,
                      const std::vector<int64_t>& counts, const torch::Tensor& features_TKH);
  // Drafts of the listed slots' blocks (all of verify size V > 1) over their cached context: V-1 ids
  // per slot; when sampling, also each slot's q rows (Slot::q_RV).
  std::vector<std::vector<int64_t>> draft(const model::DrafterContextCache& context, std::vector<Slot>& slots,
                                          const std::vector<int64_t>& which, int64_t V, const SpecDecodeOptions& opt);
  // draft() of a dspark or dflash2 drafter: the method's block and walk (core/eval/successor_draft.h).
  std::vector<std::vector<int64_t>> draft_successor(const model::DrafterContextCache& context, std::vector<Slot>& slots,
                                                    const std::vector<int64_t>& which, int64_t V,
                                                    const SpecDecodeOptions& opt);
  // Sampling: per listed slot, [V-1 acceptance flags (0/1), then V candidates c] (see above).
  std::vector<std::vector<int64_t>> sample_verdicts(std::vector<Slot>& slots, const std::vector<int64_t>& which,
                                                    const std::vector<int64_t>& lengths,
                                                    const std::vector<std::vector<int64_t>>& drafts,
                                                    const torch::Tensor& logits_RV, const SpecDecodeOptions& opt);

  model::TargetModel& target_;
  model::DrafterConfig cfg_;
  model::CaptureSpec capture_;
  std::vector<torch::Tensor> weights_;  // in Drafter parameter order, target dtype/device
  std::map<int64_t, std::unique_ptr<model::Drafter>> by_block_size_;
};

// The most tokens one round verifies (and produces) with B = SpecDecodeOptions::block_size (or the
// drafter's): B for dflash and dflash2, B + 1 for dspark (B drafts and the bonus token).
int64_t verify_width(const model::DrafterConfig& drafter, int64_t block_size);

// DataError when the prompt is empty or holds a token outside [0, vocab).
void check_prompt(const std::vector<int64_t>& prompt, int64_t vocab);

// The target's own greedy decoding by full re-forwards (no cache): max_new_tokens argmax steps,
// stopping after (and including) the first stop token. The reference speculative decoding must equal.
std::vector<int64_t> greedy_generate(model::TargetModel& target, const std::vector<int64_t>& prompt,
                                     int64_t max_new_tokens, const std::vector<int64_t>& stop_token_ids = {});

}  // namespace dflash::eval
