"""``+experiment=spike``: replay one bad batch under each clipping policy and measure the damage.

The failure it replays: a run's loss flattens after one batch whose gradient norm is 20× its
previous peak; with a global clip at 1.0 the same batch becomes a unit-norm
update and training survives. This experiment replays it on the default task, from one seed and
one data order, as child runs of one MLflow parent run. Each clipping policy runs twice, an
unspiked twin (the normal batch at ``spike.at_step``) and the spiked run:

- ``none`` (``clip=none``): children ``none-reference`` and ``none``;
- ``fixed`` (global clip at ``spike.fixed_max_norm``): ``fixed-reference`` and ``fixed``;
- ``calibrated`` (``clip=calibrated`` from ``calibrate.*``: τ = Quantile_q of the calibration window that ends before
  the spike): ``reference`` and ``calibrated``;
- with ``spike.fp16=true``, the calibrated pair again in fp16 on a smaller GPT
  (``spike.fp16_overrides``): ``fp16-reference`` and ``fp16-calibrated``. There the spike
  overflows the loss scale: the step must be skipped, the scale backed off and the run continue
  with finite parameters (or, without overflow, the spike must be clipped); a violation fails
  the parent run. Where the unspiked twin overflowed at that step too, the comparison is void
  (neither survived nor failed: both skipped it and are the same run after it).

Why a twin per policy: the policies already differ before the spike (clipping at 1.0 through the
warm-up transient trains a different model than an unclipped calibration window does), so a
single reference would mix that difference into the spike's damage. A twin has the same seed,
data order and policy as its spiked run, so the two are the same run, bit for bit, until the
spike; ``pre_spike_gap`` still reports each policy's distance from the calibrated run's twin of its precision
(``reference``, or ``fp16-reference`` for the fp16 pair).

The corrupted batch. At the spike step the batch is replaced by a *binary blob*: seeded uniform
random bytes as inputs and targets (what a compressed or binary file that slipped into a text
corpus, or a misaligned read, feeds a byte-level LM). The cross-entropy gradient is bounded per
token, so the blob's own gradient norm is only a few × the recent peak; its loss is therefore
also multiplied by ``k`` (what a normalisation bug does, e.g. a summed loss divided by a wrong
token count). ``k`` is solved so that the pre-clip
norm is ``spike.factor`` × the running peak: inside the twin, at the spike step, the live model
(the weights after step ``at_step − 1``, bit-identical in the spiked run) computes the blob's
gradient with ``torch.autograd.grad`` (``.grad`` untouched; bf16 autocast for bf16 runs, fp32 for
fp16/fp32 runs) and the gradient is linear in ``k``. The running peak is the largest finite
pre-clip norm of the ``spike.peak_window`` steps before the spike (0: since step 1): a
"previous peak" late in training is not the initialisation transient of step 1.

Measurements. ``loss_excess_H = loss / twin's loss − 1`` at step ``at_step + H``, per step and
unsmoothed: both runs see the identical batch at every step but the spike step, so batch-to-batch
difficulty cancels (the remaining noise is ≈ ±0.5% on the default task). ``recovery_steps``:
the first H ≥ 1 from which ``|excess|`` stays ≤ ``spike.recovery_tolerance`` until the end of the
run (an arm that drifts out again later has not recovered; out *below* its twin too: a loss 8% under
the twin's is a run the spike sent elsewhere, not one back on its twin); an arm still outside at its last
step logs the steps it had left + 1 and ``recovered = 0``. The twins log the same metrics (zeros).
"""
