#!/bin/bash
# The agent works in /app (the image's WORKDIR); reward 1 when count.txt says 5.
if [ "$(tr -d '[:space:]' < /app/count.txt 2>/dev/null)" = "5" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
