#!/bin/bash
# Writes a breakdown: "reward" decides, "wrote_file" is reported alongside.
python3 /tests/check_total.py > /logs/verifier/reward.json
