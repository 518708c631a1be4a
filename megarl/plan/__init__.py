"""Capacity planning for asynchronous RL: LlamaRL's s.7 step-time model and PipelineRL's App. A.

    from megarl.plan.inputs import PlanInputs
    from megarl.plan.llamarl_model import plan_from_inputs
    result = plan_from_inputs(PlanInputs(model="llama3-405b", gpus=1024))
    result.best_async, result.best_sync, result.speedup

Modules: hardware (H100 numbers), inputs (PlanInputs, lengths, layouts), activations (trainer
memory by Korthikanti et al.'s accounting, for the recompute / SP / CP / VPP settings), engines
(SGLang vs megarl's torch engine), costs (eta_t, eta_g, memory), measured (tables replacing eta),
weight_sync_cost, llamarl_model (search), llamarl_theorem (Theorem 7.5), pipeline_appendix,
scenarios (the papers' own settings, `--scenario`), report, cli (`megarl plan`), config_plan
(`megarl plan --config FILE`: a run config's layout priced as the trainer runs it -- refused if it
does not fit -- balanced and searched), dry_run (`--dry-run-topology`: ranks, groups and the
weight-sync plan of a config checked from shapes). DESIGN.md: the model and the papers' figures.
Pure Python: torch is imported only to build weight-sync plans (prediction, dry run).
"""
