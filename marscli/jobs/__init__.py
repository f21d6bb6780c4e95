"""Orchestration of marscli's jobs: generate, calibrate, bench."""
