"""The DSA model as functions of weights and arrays, one concern a module:

  ops               norms, rope, the Hadamard rotation, weights and linears, embedding, logits
  attention_inputs  what a layer's attention takes from the rows (MLA's and the indexer's)
  mla               MLA's query rows and its output projected to hidden space
  indexer           the DSA indexer's query heads, head weights and keys
  router            which experts each token goes to
  moe               the routed experts, given the choices
  mlp               a layer's MLP: dense SwiGLU, or routed plus shared experts
  layers            the layer stack (`forward`), with an attention callback
  halves            a chunk as two interleaved halves of its rows
  attention         the sharded sparse attention over the paged pool, one shard
  attention_modes   gather_q or gather_kv, and how split rows attend, priced
  shard_selection   a shard's indexer scores and the global top-K
  host_latent       a step's pages staged from a latent cache held in host memory
  expert_groups     a device's experts where they lie in groups
  sampler           sampling on the device
  scopes            the step's phases as named scopes
  oracle            the dense single-device oracle the sharded path is checked against
  recall            the recall-trained small model the needle benchmarks serve
  source            where a served model's weights come from
  byte_tokenizer    the built-in models' byte tokenizer

The model holds maths only: where it runs a Pallas kernel rather than XLA, and every row
threshold of that choice, is kernels/dispatch.py's (`MODEL_KERNELS`).

May import cp_runtime.parallel, cp_runtime.cache and cp_runtime.weights, config, dtypes and the
kernels.
"""
