"""The README's embedding example, run and type-checked by tests/test_readme.py."""

from purepp.batch import BatchFacts
from purepp.relay import RelayConfig, consume_previous_step, end_step, init_relay, receive

config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=8, num_speculative_steps=0)
state = init_relay(config)
batch = BatchFacts(
    idx_mapping=[0, 1], num_computed_tokens=[4, 9], num_scheduled_tokens=[1, 1], prefill_len=[4, 4]
)
consumed = consume_previous_step(config, state)  # the entry from pp_size steps ago, or None
assert consumed.result is None  # nothing was received pp_size steps ago
posted = receive(config, consumed.state, batch)  # post this step's receives into the ring
assert posted.result  # every row of the batch needs its sampled token
for effect in posted.effects:  # hand these to an interpreter
    print(effect)
state = posted.state
state = end_step(config, state).state
