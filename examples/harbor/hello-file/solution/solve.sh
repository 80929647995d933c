#!/bin/bash
echo hello > greeting.txt
