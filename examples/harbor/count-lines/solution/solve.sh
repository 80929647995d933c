#!/bin/bash
wc -l < events.log > count.txt
