#!/bin/bash
# Reward 1 when /work/greeting.txt holds exactly "hello" (a trailing newline is fine).
if [ "$(cat /work/greeting.txt 2>/dev/null)" = "hello" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
