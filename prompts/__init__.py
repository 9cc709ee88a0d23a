"""The prompt source: issues the task's prompts onto ``prompts``, paced by the policy version the
producers run, and keeps the ledger of every issued prompt. A stage: imports bus, configs and tasks.
"""
