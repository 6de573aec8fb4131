#!/bin/bash
wc -l < /app/files/words.txt > /app/count.txt
