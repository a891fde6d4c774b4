"""The agent harness: chat/tool-call format, tools, sandbox, workspace, policies, episode runner.

  chat_format   append-only token format; render env segments, parse model messages
  tools         read_file, list_dir, grep, edit_file, write_file, run, run_tests
  sandbox       Sandbox(SandboxLimits).run(argv, workdir, timeout_s, stdin) -> RunResult (bwrap)
  workspace     Workspace.create(task, sandbox=...) private repo copy; diff(); cleanup()
  policy        OraclePolicy, DoNothingPolicy, ScriptedPolicy, SamplerPolicy(sampler)
  runner        run_episode(task, policy, tokenizer, sandbox, config) -> EpisodeResult;
                run_episodes(tasks, policy_factory, ..., concurrency=8)
  task_protocol what the harness needs from a task (c2jax.tasks.base.Task satisfies it)
"""
