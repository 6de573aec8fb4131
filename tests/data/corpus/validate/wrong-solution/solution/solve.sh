#!/bin/bash
echo 7 > /app/count.txt
