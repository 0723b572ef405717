"""Messages of the JAX frontend's semantic errors: each says what to do."""

from __future__ import annotations

NO_TRANSCRIPT_UPDATE = (
    "No transcript update: a zkdv.jax.contrib.TrainState was created with this proof, but "
    "no proof.jit step ran, so the transcript is empty. The training step still uses "
    "jax.jit: decorate the function containing apply_gradients() with proof.jit."
)
PROOF_IDENTITY = (
    "Proof identity error: the TrainState passed to this proof.jit step was created with "
    "{owner}, not with the proof that compiles the step. Use the exact instance returned "
    "for this experiment: TrainState.create(proof=proof, ...)."
)
ATTEST_REGISTERED = (
    "Attested program already registered: this proof has a manual proof.attest function, "
    "but the step uses zkdv.jax.contrib.TrainState, whose attested program is generated "
    "automatically. Remove the manual proof.attest function when using the TrainState "
    "integration."
)
#: ATTEST_REGISTERED for a step whose transaction commits its gradient, by source.
ATTEST_COMMITTED = {
    "transaction": (
        "Attested program already registered: this proof has a manual proof.attest "
        "function, but the step's zkdv.jax.Transaction commits its gradient "
        "(transaction.apply(tx, grads) or transaction.update(..., grads=, tx=)), and its "
        "replayed program is generated automatically. Remove the manual proof.attest "
        "function."
    ),
}
ATTEST_TWICE = (
    "Attested program already registered: proof.attest was already called for this proof; "
    "register exactly one attested function before the first step."
)
STATIC_ARGUMENT = (
    "Static argument error: automatic attestation fixed the static arguments {names} on the "
    "first training invocation ({old}); this call passes {new}. Keep their values unchanged "
    "for this compiled step, or make the value a supported dynamic input."
)
INCOMPATIBLE = (
    "the inputs of this proof.jit call are not compatible with the first compiled "
    "invocation ({detail}); the parameter and optimizer PyTrees, the input representation "
    "and the device layout are fixed by the first step (drop or pad a short last batch)"
)
EXPORT_FAILURE = (
    "Export or replay failure: the attested program could not be exported with jax.export "
    "({error}). Pass randomness explicitly as a dynamic argument (for example a PRNG key), "
    "and if apply_fn uses a custom or non-exportable kernel, supply attest_apply_fn, a "
    "deterministic, equivalent implementation used only in sampled replay."
)
NO_ATTEST = (
    "the explicit zkdv.jax.Transaction API needs the attested program: register it with "
    "@proof.attest (params, opt_state, batch, parameter_index, optimizer_state_index) "
    "before the first proof.jit step"
)
NO_TRANSITION = (
    "replay_snapshot_interval={interval} replays up to {steps} full transitions from a "
    "snapshot, but the attested function does not select its outputs with zkdv.jax.index "
    "from the full update and optimizer-state trees, so ZKDV cannot derive the full "
    "transition. Return zkdv.jax.index(updates, parameter_index) and "
    "zkdv.jax.index(new_opt_state, optimizer_state_index), or use "
    "replay_snapshot_interval=1."
)
DONATED_OPT_STATE = (
    "Pre-update optimizer state cannot be donated: a sampled check may still need it. "
    "Remove the optimizer-state argument from donate_argnums/donate_argnames (parameters "
    "may be donated; a donated contrib TrainState donates only its parameters)."
)
NO_TRANSACTION = (
    "the proof.jit function declared no transaction: call apply_gradients() on the "
    "zkdv.jax.contrib.TrainState passed to it, or declare zkdv.jax.Transaction(...) and "
    "transaction.update(...) in it"
)
NOT_AN_INPUT = (
    "ZKDV transaction {name} must be a subtree of the proof.jit function's inputs: call "
    "apply_gradients() on (or build the Transaction from) the state passed to the step, "
    "unmodified before the update"
)
STRUCTURE = "ZKDV transaction {name} must have the structure of {like} ({got} != {want})"
MODIFIED_OUTSIDE = (
    "the {tree} passed to step {step} are not the state committed after step {previous}: "
    "they were modified outside a proof.jit step. Every update of the training state must "
    "go through the proof.jit step."
)
ATTEST_OUTPUTS = (
    "the ZKDV.attest function must return two scalar floating-point values "
    "(selected_delta, selected_post_optimizer_state), got {got}"
)
UNTRACKED_UPDATE = (
    "a zkdv.jax.contrib.TrainState created with a proof is being updated under jax.jit, "
    "so this update is not in the transcript; decorate the step with proof.jit"
)
MULTI_PROCESS_SHARDED = (
    "zkdv.jax records multi-process runs (jax.process_count() == {count}) whose committed "
    "state is replicated across processes: process 0 owns the transcript and must read "
    "every parameter and optimizer-state leaf whole, but {leaves} are split across "
    "processes. Replicate them across processes (data parallelism; sharding among one "
    "process's devices is fine), or run one process with all devices."
)

DEVICE_MULTI_PROCESS = (
    "ZKDVConfig(commitments='device') is not available in a multi-process run "
    "(jax.process_count() == {count}): process 0 alone commits, and a device program "
    "over global arrays would need every process. Use commitments='auto' or 'host'."
)

DEVICE_DTYPES = (
    "ZKDVConfig(commitments='device') cannot hash {leaves} on the device (sub-byte or "
    "non-numeric dtypes); use commitments='auto' or 'host' for this state."
)
NESTED_UPDATE = (
    "the training update was declared inside a JAX transformation of the proof.jit step "
    "(jax.lax.scan, fori_loop, cond, vmap or a nested jit), where ZKDV cannot reach its "
    "values. For several updates per compiled call, replace jax.lax.scan with "
    "zkdv.jax.scan (same arguments): every update inside it is committed as its own step. "
    "Otherwise declare the update once, at the top level of the step."
)
SCAN_STATE_NOT_CARRY = (
    "zkdv.jax.scan: the state whose apply_gradients() the scan body calls must be part of "
    "the scan's carry, unmodified before the update (body(carry, x) with carry = state, or "
    "a tuple holding it)"
)
SCAN_STATE_NOT_RETURNED = (
    "zkdv.jax.scan: the scan body must return the state that apply_gradients() returned "
    "in the same place of its carry (return new_state, y), so that each update starts "
    "from the state the previous one committed"
)
SCAN_NOT_TRAIN_STATE = (
    "zkdv.jax.scan commits updates declared by zkdv.jax.contrib.TrainState.apply_gradients(); "
    "an update declared with zkdv.jax.Transaction inside a scan is not supported"
)
SCAN_MULTI_PROCESS = (
    "zkdv.jax.scan with updates inside is not supported in multi-process runs "
    "(jax.process_count() == {count}); run one update per proof.jit call there"
)
SCAN_DEVICE = (
    "ZKDVConfig(commitments='device') does not commit zkdv.jax.scan updates yet: the loop "
    "returns every update's state stacked and the host hashes them; use "
    "commitments='auto' (which chooses 'host' for such a step) or 'host'"
)
SCAN_TWICE = (
    "a proof.jit step may contain one zkdv.jax.scan whose body updates the state; this "
    "step already declared its updates"
)
NNX_NO_UPDATE = (
    "the proof.jit function declared no update: call optimizer.update(model, grads) on "
    "the nnx.Optimizer passed to it (or apply_gradients() on a zkdv.jax.contrib.TrainState)"
)
NNX_MODEL_NOT_AN_INPUT = (
    "optimizer.update(model, grads) inside a proof.jit step must update a model passed to "
    "the step as an argument, unmodified before the update; its parameters are not among "
    "the step's inputs"
)
NNX_RETURNED_OBJECT = (
    "a proof.jit step with Flax NNX arguments returns arrays (a loss, metrics' values), not "
    "NNX objects: the objects passed in are updated in place, as under nnx.jit"
)
NNX_STRUCTURE_CHANGED = (
    "the proof.jit step changed the structure of the Flax NNX argument {name!r} (added or "
    "removed a variable or submodule); the committed program fixes it at the first step, "
    "so create every variable before training"
)
NNX_SHARED = (
    "the Flax NNX arguments {first!r} and {second!r} of this proof.jit step share "
    "variables (the same object passed twice, or a model also held by an "
    "nnx.ModelAndOptimizer); pass each object once"
)

# Committed gradients (zkdv.jax._optimizer): what a step's optimizer update must be.
TWO_UPDATES = (
    "a proof.jit step applies its optimizer once: this step called the update of its "
    "Optax transformation twice (one apply_gradients(), optimizer.update() or "
    "transaction.apply() per step)"
)
EXTRA_ARGUMENTS = (
    "the optimizer update of a proof.jit step received extra arguments {names} "
    "(GradientTransformationExtraArgs): only the gradient, the optimizer state and the "
    "parameters are committed and replayed, so such an update cannot be committed"
)
UPDATE_NOT_STATE = (
    "the optimizer update of a proof.jit step must read the transaction's own {what} as "
    "passed to the step; it read a value computed inside the step"
)
UPDATE_NOT_APPLIED = (
    "the optimizer's updates were never applied to the parameters in this proof.jit step"
)
GRADIENT_STRUCTURE = (
    "the gradient the optimizer received does not have the structure of the parameters it updates"
)
PARAMETER_WRITTEN = (
    "a proof.jit step that commits its gradient must leave each parameter as its optimizer "
    "update wrote it: a parameter was changed after (or besides) the update. Change it "
    "inside the Optax transformation (optax.chain(...)) so the committed update does it"
)
GRADIENT_DTYPE = (
    "the gradient of a parameter is {got}, the parameter {want}: a committed gradient has "
    "its parameter's dtype and shape (cast the gradient before the update)"
)
STATE_NOT_RETURNED = (
    "the optimizer state after a proof.jit step must be the state the optimizer update "
    "returned, unchanged"
)
APPLY_MISMATCH = (
    "the committed apply program does not reproduce step 0's post-update {tree} from its "
    "committed gradient ({leaf} differs): the step changes its training state in a way "
    "the replay cannot see. Keep every change of the state inside the Optax update or the "
    "values the step passes to apply_gradients()"
)
TRANSACTION_BATCH = (
    "transaction.apply() commits the step's gradient, and the platform recomputes it from "
    "the committed state and batch alone: every input of the proof.jit function other "
    "than params and opt_state must be a leaf of the transaction's batch (unmodified), "
    "but {count} input leaves are not"
)
