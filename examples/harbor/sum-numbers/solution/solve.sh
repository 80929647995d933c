#!/bin/bash
python3 -c "print(sum(int(line) for line in open('numbers.txt')))" > total.txt
