#!/bin/bash
echo 41 > /app/answer.txt
