"""The prompt sets of the chat-model suites, written for this project.

Four classes, what an instruction-tuned model is asked in practice:

* `CONVERSATIONS`: multi-turn chats (user, assistant, user, assistant, user); each
  user message is one prompt, with the conversation so far before it;
* `CODE`: write, fix, explain or change code (some quote code the answer will repeat);
* `QA`: short factual questions;
* `CREATIVE`: stories, poems, names, descriptions (sampled at temperature 0.8).

The assistant turns inside `CONVERSATIONS` are fixed text, so every method and run sees
the same prompts.
"""

from __future__ import annotations

CONVERSATIONS: list[list[str]] = [
    ["I want to start running. How often should a beginner run each week?",
     "Three times a week is a good start: it gives your legs a rest day between runs. Keep each run easy "
     "enough that you could hold a conversation, and alternate running with walking if you need to.",
     "How long should each of those runs be?",
     "Begin with 20 to 30 minutes, walking breaks included. Add about ten percent more time each week, "
     "and keep one week in four lighter so your body can adapt.",
     "What should I eat before a morning run?"],
    ["Can you explain what a budget is, in simple terms?",
     "A budget is a plan for your money: you write down what comes in each month and decide in advance "
     "how much goes to rent, food, savings and everything else.",
     "What is the 50/30/20 rule?",
     "It splits take-home pay into three parts: 50 percent for needs such as rent and groceries, 30 percent "
     "for wants such as eating out, and 20 percent for savings or paying off debt.",
     "My rent alone is 45 percent of my income. How should I adjust the rule?"],
    ["My tomato plants have yellow leaves at the bottom. What is wrong?",
     "Yellow lower leaves are common. The usual causes are overwatering, a lack of nitrogen, or an early "
     "fungal disease such as early blight. Check whether the soil stays soggy and whether the leaves have spots.",
     "The leaves have small brown spots with rings around them.",
     "Rings inside brown spots point to early blight, a fungus. Remove the affected leaves, water at the base "
     "of the plant instead of over the leaves, and add mulch so soil does not splash up.",
     "Is it safe to eat the tomatoes from that plant?"],
    ["I have a job interview for a data analyst role next week. How should I prepare?",
     "Review the job description and match each requirement with an example from your experience. Practice "
     "SQL queries, be ready to walk through one project in detail, and prepare a few questions for them.",
     "What kind of SQL questions do they usually ask?",
     "Expect joins between two or three tables, GROUP BY with aggregates, filtering with HAVING, window "
     "functions such as ROW_NUMBER, and finding duplicates or the top N rows per group.",
     "Can you give me one practice question with a window function?"],
    ["What is the difference between weather and climate?",
     "Weather is what the atmosphere does on a given day: rain, wind, temperature. Climate is the average "
     "of that weather over a long period, usually thirty years or more, for a region.",
     "So one very cold winter does not disprove global warming?",
     "Right. A single season is weather. Warming shows up in long-term averages, and even a warming climate "
     "still has cold winters; they just become less frequent.",
     "How do scientists measure the average temperature of the whole planet?"],
    ["I keep procrastinating on my thesis. Any advice?",
     "Break the thesis into small tasks that take under an hour, such as outlining one section. Start each "
     "day with one of them before checking email, and track what you finish.",
     "I do make lists, but I never start the first task.",
     "Then make the first step smaller still: open the document and write one sentence. Starting is the hard "
     "part; a two-minute step gets you past it, and you can stop after it if you want.",
     "What if I feel the writing is bad and I delete everything?"],
    ["Help me plan a three-day trip to Lisbon.",
     "Day one: the Alfama district, the castle and a fado evening. Day two: Belem for the tower, the monastery "
     "and the custard tarts. Day three: a day trip to Sintra for its palaces and gardens.",
     "I do not like crowds. When is the quietest time to visit?",
     "Late autumn and early spring, roughly November and March, are quieter and still mild. Visit the popular "
     "sights right at opening time, and go to Sintra on a weekday.",
     "How do I get from the airport to the city center?"],
    ["What is a good first programming language to learn?",
     "Python is a common first choice: its syntax is readable, it has a large community, and it is used for "
     "scripting, data analysis and web development.",
     "I want to build websites. Is Python still the right choice?",
     "For websites you will need HTML, CSS and JavaScript in the browser anyway. Learn those first; for the "
     "server side, Python with a framework such as Django is a fine option, and so is JavaScript with Node.",
     "How long does it take to be able to build a simple website?"],
    ["My cat scratches the sofa. How can I stop it?",
     "Give the cat a scratching post next to the sofa, tall and sturdy enough for a full stretch. Cover the "
     "scratched spots with double-sided tape, and reward the cat when it uses the post.",
     "She ignores the post completely.",
     "Try a different material: some cats prefer sisal rope, others cardboard or carpet. Rub catnip on it, "
     "and place it where she already scratches instead of in a corner.",
     "Should I trim her claws, and how often?"],
    ["Can you explain how vaccines work?",
     "A vaccine shows your immune system a harmless piece or a weakened form of a germ. Your body learns to "
     "recognise it and keeps memory cells, so it can respond quickly if the real germ arrives.",
     "Why do some vaccines need a booster?",
     "The immune memory from some vaccines fades over time, and some germs change. A booster reminds the "
     "immune system and raises antibody levels again.",
     "What is the difference between an mRNA vaccine and a traditional one?"],
    ["I want to bake bread at home for the first time.",
     "A basic loaf needs flour, water, salt and yeast. Mix, knead for about ten minutes, let the dough rise "
     "until it doubles, shape it, let it rise again and bake it at a high temperature.",
     "My dough did not rise at all. What went wrong?",
     "The yeast may have been old, or the water too hot, which kills it. Water should feel lukewarm. A cold "
     "kitchen also slows rising a lot, so give it more time in a warm spot.",
     "How can I tell when the bread is fully baked?"],
    ["What does a product manager do?",
     "A product manager decides what a product should do and why. They talk to users, set priorities, write "
     "down requirements, and work with engineers and designers to ship features.",
     "How is that different from a project manager?",
     "A project manager focuses on how and when: schedules, resources and risks for a defined project. A "
     "product manager focuses on what to build and whether it solves a real problem.",
     "Which skills should I develop to become a product manager?"],
    ["I am learning Spanish. How can I practice speaking without a partner?",
     "Talk to yourself: describe what you are doing while you cook or walk. Shadow audio by repeating a "
     "podcast sentence by sentence, and record yourself to hear your pronunciation.",
     "I freeze when I need to form sentences quickly.",
     "Learn whole phrases instead of single words, such as common openers and connectors. Practice short "
     "answers to everyday questions until they come out without thinking.",
     "Can you give me five phrases that help keep a conversation going?"],
    ["How do solar panels produce electricity?",
     "Solar panels are made of cells, usually silicon. Light knocks electrons loose in the cell, and the "
     "cell's built-in electric field pushes them into a current that flows through a circuit.",
     "Do they still work on cloudy days?",
     "Yes, at reduced output: typically 10 to 25 percent of their rating under heavy clouds, more under thin "
     "clouds. They need light, not heat.",
     "Is it worth adding a battery to a home solar system?"],
    ["I feel tired every afternoon at work.",
     "An afternoon dip is normal. It can be made worse by a heavy lunch, too little sleep, dehydration or "
     "sitting for hours. A short walk and a glass of water often help.",
     "I drink coffee at three every day to get through it.",
     "Caffeine stays in the body for hours, so coffee at three can make it harder to fall asleep, which makes "
     "the next afternoon worse. Try moving it to before lunch.",
     "What would be a better snack for the afternoon?"],
    ["Can you help me write an email asking my manager for a day off?",
     "Sure. Keep it short: the date you want off, a short reason if you wish, how your work will be covered, "
     "and a thank you. Would you like me to draft it?",
     "Yes, it is for next Friday, for a family event.",
     "Subject: Day off request for Friday. Hi Maria, I would like to take next Friday off for a family event. "
     "I will finish the weekly report by Thursday, and Tom has agreed to cover urgent requests. Thank you.",
     "Can you make it a little more formal?"],
]

CODE: list[str] = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that returns the n-th Fibonacci number using iteration.",
    "Write a SQL query that returns the five customers with the highest total order amount from tables "
    "customers(id, name) and orders(id, customer_id, amount).",
    "Explain what this Python code does:\n\n```python\nresult = [x * x for x in range(10) if x % 2 == 0]\n```",
    "Fix the bug in this function:\n\n```python\ndef average(values):\n    total = 0\n    for v in values:\n"
    "        total += v\n    return total / len(values) - 1\n```",
    "Write a JavaScript function that removes duplicate values from an array.",
    "Add type hints to this function:\n\n```python\ndef greet(name, times):\n    return ', '.join(['Hello ' + name] "
    "* times)\n```",
    "Write a bash command that counts the lines of all .py files in the current directory and its subfolders.",
    "What is the difference between a list and a tuple in Python? Show an example of each.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Convert this for loop into a list comprehension:\n\n```python\nsquares = []\nfor n in numbers:\n"
    "    if n > 0:\n        squares.append(n ** 2)\n```",
    "Write a function in C that reverses a string in place.",
    "Write a Python function that reads a CSV file and returns the rows as a list of dictionaries.",
    "Explain what a race condition is and show a small Python example with threads.",
    "Write a regular expression that matches a date in the format YYYY-MM-DD.",
    "Rename the variable x to count in this code and keep everything else the same:\n\n```python\nx = 0\nfor item "
    "in items:\n    if item.active:\n        x += 1\nprint(x)\n```",
    "Write a Python decorator that prints how long a function takes to run.",
    "Write an HTML page with a form that has a name field, an email field and a submit button.",
    "What does the `yield` keyword do in Python? Give a short example.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a SQL statement that creates a table users with an id primary key, a unique email and a created_at "
    "timestamp.",
    "Refactor this function to use a dictionary instead of if statements:\n\n```python\ndef color_code(name):\n"
    "    if name == 'red':\n        return '#ff0000'\n    elif name == 'green':\n        return '#00ff00'\n"
    "    elif name == 'blue':\n        return '#0000ff'\n    return None\n```",
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between `==` and `is` in Python.",
    "Write a JavaScript function that debounces another function.",
    "Write unit tests with pytest for a function add(a, b) that returns the sum of two numbers.",
    "Write a Python function that counts how often each word appears in a text.",
    "Write a Dockerfile for a small Python web app that runs app.py on port 8000.",
    "What is the time complexity of binary search, and why?",
    "Write a Python function that flattens a nested list such as [1, [2, [3, 4]], 5].",
    "Add a docstring to this function:\n\n```python\ndef clamp(value, low, high):\n    return max(low, "
    "min(value, high))\n```",
    "Write a Go function that returns the maximum of a slice of integers.",
    "Explain what a REST API is, with an example of a GET and a POST request.",
    "Write a Python script that renames every .txt file in a folder to add today's date to its name.",
    "Write a Python function that validates an email address with a simple regular expression.",
    "Rewrite this code to use a with statement:\n\n```python\nf = open('data.txt')\ncontent = f.read()\nf.close()\n"
    "print(content)\n```",
    "Write a Rust function that returns the sum of the even numbers in a vector.",
    "Write a git command sequence that creates a new branch, commits a change and pushes it.",
    "Write a Python function that converts a temperature from Celsius to Fahrenheit and back.",
    "Explain what recursion is and write a recursive function that computes a factorial.",
    "Write a Python function that returns the most common element of a list.",
    "Write a TypeScript interface for a user with an id, a name, an optional email and a list of roles.",
]

QA: list[str] = [
    "What is the capital of Australia?",
    "How many planets are in the solar system?",
    "Who wrote the novel Pride and Prejudice?",
    "What is the boiling point of water at sea level in degrees Celsius?",
    "What is the largest ocean on Earth?",
    "What gas do plants absorb from the air for photosynthesis?",
    "In which year did the first person walk on the Moon?",
    "What is the chemical symbol for gold?",
    "How many bones are in the adult human body?",
    "What is the longest river in Africa?",
    "Who painted the Mona Lisa?",
    "What is the speed of light in a vacuum, approximately?",
    "What is the smallest prime number?",
    "Which planet is known as the Red Planet?",
    "What language has the most native speakers in the world?",
    "What is the freezing point of water in degrees Fahrenheit?",
    "What organ pumps blood through the human body?",
    "Who developed the theory of general relativity?",
    "What is the tallest mountain on Earth?",
    "How many continents are there?",
    "What is the main ingredient of guacamole?",
    "What is the currency of Japan?",
    "What does DNA stand for?",
    "What is the hardest natural substance?",
    "Which country has the largest population in South America?",
    "What is the square root of 144?",
    "Who invented the telephone?",
    "What is the largest desert in the world?",
    "How many minutes are in a day?",
    "What is the capital of Canada?",
    "Which element has the atomic number 1?",
    "What is the name of the galaxy that contains our solar system?",
    "What instrument has 88 keys?",
    "In which country are the pyramids of Giza?",
    "What is the largest mammal?",
    "What is the official language of Brazil?",
    "How many sides does a hexagon have?",
    "What is the primary function of red blood cells?",
    "Which scientist proposed the three laws of motion?",
    "What is the capital of Kenya?",
    "What is the process by which water changes from liquid to gas called?",
    "How many days does it take the Earth to orbit the Sun?",
]

CREATIVE: list[str] = [
    "Write a short poem about the first snow of winter.",
    "Tell a short story about a robot who learns to paint.",
    "Write a haiku about a quiet morning at the lake.",
    "Describe a city on the ocean floor in a few sentences.",
    "Invent a name and a slogan for a bakery that only sells bread made with local grain.",
    "Write the opening paragraph of a mystery novel set in a lighthouse.",
    "Write a limerick about a cat who loves to sleep in boxes.",
    "Describe the taste of a strawberry to someone who has never had one.",
    "Write a letter from a dragon to the village it used to frighten.",
    "Tell a bedtime story about a small star that is afraid of the dark.",
    "Write a short dialogue between the sun and the moon.",
    "Imagine a holiday that does not exist yet. Describe how people celebrate it.",
    "Write a poem about an old bicycle in a garage.",
    "Describe a forest in autumn using all five senses.",
    "Write a short fable with a lesson about patience.",
    "Invent a new board game and explain its rules in a few sentences.",
    "Write a song chorus about driving home at night.",
    "Tell a story about a librarian who finds a book that writes itself.",
    "Write a motivational speech for a team that just lost a close game.",
    "Describe a sunrise on Mars.",
    "Write a poem from the point of view of a house plant.",
    "Invent three names for a friendly alien species and describe their home planet.",
    "Write a short story that begins with the sentence: The key did not fit any door in the house.",
    "Write a thank-you note to a teacher, in a warm and playful tone.",
    "Describe a busy market in a fantasy city.",
    "Write a haiku about rain on a tin roof.",
    "Tell a short story about two friends who build a raft.",
    "Write a product description for an umbrella that never gets wet.",
    "Write a poem about the sound of a train at night.",
    "Imagine you are a time traveler visiting a town in the year 1900. Describe your first hour.",
    "Write a short scene in which a chef cooks a meal for a king who hates everything.",
    "Describe the feeling of finishing a long hike.",
    "Write a riddle whose answer is a shadow.",
    "Tell a story about a village where it rains only on Tuesdays.",
    "Write a poem about friendship in four short stanzas.",
    "Describe a winter cabin where someone is waiting for a letter.",
    "Invent a superhero whose power is very small but useful, and describe one of their days.",
    "Write a short ghost story that ends happily.",
    "Write a postcard from a penguin on vacation in the desert.",
    "Describe an old map that leads somewhere unexpected.",
    "Write an ode to a cup of morning coffee.",
    "Tell a story about a clockmaker who can slow down time for one minute each day.",
]
