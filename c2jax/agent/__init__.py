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

Public interface (what c2jax.tasks may import; tests/test_import_graph.py checks it):
task_protocol, policy_protocol, chat_format, sandbox, workspace. The rest (tools, policy, runner,
summarize) are the harness's insides.
"""
