mkdir -p /workspace/logs
echo 'seeded by setup' > /workspace/logs/setup.txt
useradd -m user
