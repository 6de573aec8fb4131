printf "id,v\n1,a\n" > /home/user/export.csv
