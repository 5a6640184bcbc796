"""Metrics, tracking (console, metrics.jsonl, mlflow), progress display and the run report.

How the training loop uses these pieces (one step)::

    timer = Timer()                                   # megarl.trainer.timing
    progress = Progress(total_steps, start_step=resume_step or 0, enabled=cfg.trainer.progress_bar)
    tracker = tracker_from_config(cfg, resume_step=resume_step, console_write=progress.write)
    progress.start()
    for step in range(start + 1, total_steps + 1):
        with timer("step"):
            with timer("gen"), progress.phase("gen"):
                batch = actor.generate(prompts)
            ...
        timings = timer.pop()
        total_tokens, response_tokens = count_tokens(batch)
        metrics = {**compute_data_metrics(batch), **compute_timing_metrics(timings, total_tokens, response_tokens),
                   **compute_throughput(total_tokens, timings["step"], n_devices), **actor_metrics}
        tracker.log(metrics, step)
        progress.step_done(step, reward=metrics["critic/score/mean"])
    tracker.close(); progress.close(); write_report(run_dir)

Modules import lazily (mlflow and matplotlib are slow to import): import from the submodules.
"""
