"""The agent harness: chat/tool-call format, tools, sandbox, workspace, policies, episode runner.

  chat_format     append-only token format; render env segments, parse model messages
  tools           read_file, list_dir, grep, edit_file, write_file, run, run_tests
  sandbox         Sandbox(SandboxLimits).run(argv, workdir, timeout_s, stdin) -> RunResult (bwrap)
  workspace       Workspace.create(task, sandbox=...) private repo copy; diff(); cleanup()
  policy_protocol what the harness asks of a policy: Policy, PolicyOutput, TextPolicy, and the
                  summary requests (SUMMARIZE_QUERY, COMPACTION_SYSTEM)
  policy          OraclePolicy, DoNothingPolicy, ScriptedPolicy, SamplerPolicy(sampler)
  runner          run_episode(task, policy, tokenizer, sandbox, config) -> EpisodeResult;
                  run_episodes(tasks, policy_factory, ..., concurrency=8)
  summarize       self-summarization and its baselines (context hooks for the runner)
  task_protocol   what the harness needs from a task (c2jax.tasks.base.Task satisfies it)
  long_horizon_policy  the scripted agent for c2jax.tasks.long_horizon

The harness sits above c2jax.tasks and c2jax.data (docs/ARCHITECTURE.md): tasks import nothing
of it (their graders read trees through c2jax.filetree, which workspace uses too).
"""
