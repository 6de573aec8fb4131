#!/bin/bash
echo 42 > /app/answer.txt
sleep 300
